"""User-facing errors: one clear line naming what to fix."""


class DsparkError(Exception):
    """An error caused by user input or environment; the CLI prints it as one line and exits 1."""
