"""Optional dependencies: the core install runs without them, and says once what it skipped.

    matplotlib = optional_import("matplotlib", skipped="the plots (plots/*.png)", extra="plots")
    if matplotlib is None:
        return None          # one line on stderr said what was skipped and which extra brings it

`pip install conveyor` installs what training needs; outputs meant for people come as extras
(pyproject.toml): `plots` (matplotlib), `tensorboard` (TensorBoard), `examples` (scikit-learn, for
the digits demo's data), `k8s` (PyYAML, for `conveyor k8s`) and `all`. A missing extra must not fail
a training run that took hours: the output it would have made is skipped, and the notice is printed
once per process, not once per call (the trainer draws two plots, and a sink may be opened again
after a restart).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

__all__ = ["missing_extra_notice", "optional_import"]

_NOTIFIED: set[tuple[str, str, str]] = set()  # (package, skipped, extra) already announced


def missing_extra_notice(package: str, skipped: str, extra: str, error: ImportError) -> str:
    """The one-line notice: what was skipped, why, and the install command that brings it."""
    reason = (str(error).splitlines() or [type(error).__name__])[0]
    return (f"conveyor: skipped {skipped}: {package} is not installed ({reason}); "
            f"pip install 'conveyor[{extra}]' brings it")


def optional_import(module: str, *, skipped: str, extra: str, package: str | None = None) -> ModuleType | None:
    """`module`, imported; or None after printing, once per process, what is skipped without it.

    `package` is the distribution to name in the notice when it is not `module`'s top-level name
    (`torch.utils.tensorboard` needs `tensorboard`).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = package or module.partition(".")[0]
        if (package, skipped, extra) not in _NOTIFIED:
            _NOTIFIED.add((package, skipped, extra))
            print(missing_extra_notice(package, skipped, extra, e), file=sys.stderr, flush=True)
        return None
