"""Small utilities every room uses: errors, console, paths, JSON files, atomic writes."""
