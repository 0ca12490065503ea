"""Errors that reach the user as one line and a non-zero exit."""


class UserError(Exception):
    """A problem the user can fix: printed as ``tierfs: <message>``, exit status 1.

    The message says what went wrong, where, and what to do; never a traceback.
    """
