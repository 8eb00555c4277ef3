"""The command layer: ``cocodiff simulate | plan | run | calibrate | collective | doctor``.

Each module here turns one command's flags into calls on the rooms below and its results
into tables, JSON and exit codes. Command-line parsing (argparse) lives here and nowhere
else; nothing outside this package imports from it. ``cli`` holds the parser and
``main`` (the console script), where a user error becomes one line and exit code 2.
"""
