"""User-facing errors: the CLI prints ``str(err)`` as one line and exits 2; the server answers 4xx."""


class KVFlowError(Exception):
    """Base for every error caused by input (model name, path, config, request, stored data)."""


class ConfigError(KVFlowError):
    """A configuration value is missing, malformed or out of range."""


class ModelError(KVFlowError):
    """Unknown model name, unreadable checkpoint, or an architecture kvflow cannot drive."""


class RecordError(KVFlowError):
    """A stored KV record is corrupt, truncated, or belongs to another key or model."""


class StoreError(KVFlowError):
    """A put could not make every record durable (strict mode): names the device and the cause. ``stored`` records
    of the put were stored and are served; ``failed`` were not."""

    def __init__(self, message: str, stored: int = 0, failed: int = 0):
        super().__init__(message)
        self.stored = stored
        self.failed = failed
