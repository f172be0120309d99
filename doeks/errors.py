"""Errors typed by what the caller should do about them."""


class DoeksError(Exception):
    """A failure the user can fix; its message is one line saying what went wrong and what to do."""


class SettingsError(DoeksError):
    """A `.env` key holds a value doeks does not accept."""


class MissingTool(DoeksError):
    """A program or package doeks needs is not installed."""


class Retryable(DoeksError):
    """A transient failure (a server not up yet, a port busy): trying again later may work."""
