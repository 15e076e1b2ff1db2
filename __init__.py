"""This checkout, imported as ``ringflow`` because Python runs in the folder that contains it.

A checkout named ``ringflow`` sits first on ``sys.path`` when Python starts in its parent
folder. Without this file Python would make it a namespace package that shadows the installed
ringflow (``module 'ringflow' has no attribute 'load_profile'``). With it, the checkout is the
package itself: the folders pyproject.toml's ``package-dir`` maps (``ringflow/`` and the top-level
``orchestrator/``, ``graphs/``, ...), then ``ringflow/__init__.py``. Nothing ships this file.
"""

from pathlib import Path as _Path

_ROOT = _Path(__file__).resolve().parent
__path__ = [str(_ROOT / "ringflow"), str(_ROOT)]
__file__ = str(_ROOT / "ringflow" / "__init__.py")
exec(compile(_Path(__file__).read_text(), __file__, "exec"))  # the package's own first lines
