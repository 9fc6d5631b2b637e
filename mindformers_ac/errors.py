"""The one exception type for rejected configurations."""


class ConfigError(ValueError):
    """A config (YAML, dict or dataclass) or a config/model combination was rejected.

    ``field`` is the path of the offending value (``swap.op_swap[1].layers[0]``),
    ``None`` when the error concerns the file or the model as a whole. The message
    always starts with that path, then says what was expected and what was found.
    Nothing has been changed on the model when this is raised.
    """

    def __init__(self, field, message):
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}" if field else message)
