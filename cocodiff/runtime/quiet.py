"""Keeping the libraries' chatter out of a command's output."""


def quiet_libraries() -> None:
    """Silence transformers' and diffusers' warnings and progress bars.

    Call it before importing diffusers pipelines: importing them already warns (about
    torchvision missing, deprecations), and a user error must stay one line on stderr.
    Errors still surface as exceptions.
    """
    import transformers
    from diffusers.utils import logging as diffusers_logging

    transformers.logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
