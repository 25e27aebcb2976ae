"""Optional dependencies: what only some users need is an extra of the package (pyproject.toml), imported here.

    plot    matplotlib   the PNGs of benchmarks and demos
    client  openai       the OpenAI client (and httpx) of `kvflow bench serve|soak` and `kvflow demo`
    redis   redis        the remote pool tier (a Redis / Valkey store)

``require("plot")`` returns the module, or raises the one-line ConfigError (exit 2 from the CLI) that names the
extra to install; ``make setup`` installs all of them.
"""

import importlib
from types import ModuleType

from kvflow.errors import ConfigError

EXTRAS = {"plot": ("matplotlib", "plotting"),
          "client": ("openai", "the OpenAI client"),
          "redis": ("redis", "the remote pool tier")}


def require(extra: str, module: str | None = None) -> ModuleType:
    """The extra's module (or ``module``, another package the extra installs, e.g. httpx with ``client``)."""
    main, what = EXTRAS[extra]
    module = module or main
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:              # the extra is there but one of its own imports is broken: not ours
            raise
        raise ConfigError(f"{what} needs the Python package {module!r}, which is not installed: "
                          f"pip install 'kvflow[{extra}]'") from None
