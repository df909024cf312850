"""The one error type of the converter: what went wrong, said so that a user can fix it."""


class ConvertError(ValueError):
    """A checkpoint, a target or an output path that the converter cannot use."""
