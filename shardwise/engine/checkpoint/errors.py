"""The one error a checkpoint, a state dict or a weights file that cannot be loaded raises."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, partial, corrupt, or of another model."""
