"""``import bayeslayer`` makes ``transformers``' Auto classes know the model, without importing ``transformers``.

``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` find :class:`~bayeslayer.models.BayesLayerConfig`
and its models once :mod:`bayeslayer.models` has registered them, and importing that module means importing
``transformers`` (several seconds).  ``transformers`` is an optional dependency of the core package, so
``import bayeslayer`` does not import it; :func:`install` instead registers the model the moment
``transformers`` loads its Auto classes (``transformers.models.auto.modeling_auto``, or
``configuration_auto`` for ``AutoConfig`` alone), by an import hook on those two modules.  If they are
already loaded, it registers at once.  So::

    import bayeslayer
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("runs/lm/tiny/final")   # a folder the package saved

works with nothing else imported.  A failure to register (an incompatible ``transformers``) is a warning,
never an error in the user's ``transformers`` import.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

CONFIGURATION_AUTO = "transformers.models.auto.configuration_auto"
MODELING_AUTO = "transformers.models.auto.modeling_auto"
_state = {"registered": False, "busy": False}


def register() -> None:
    """Register the config and model classes with the Auto classes now (imports :mod:`bayeslayer.models`)."""
    if _state["registered"] or _state["busy"]:
        return
    _state["busy"] = True
    try:
        import bayeslayer.models  # noqa: F401  (its import registers the classes)
    except Exception as err:  # the user's transformers import must not fail on our account
        warnings.warn(f"bayeslayer could not register its model with transformers' Auto classes: "
                      f"{type(err).__name__}: {err}", ImportWarning, stacklevel=2)
    else:
        _state["registered"] = True
    finally:
        _state["busy"] = False


def _loaded(name: str) -> None:
    # configuration_auto finishes loading before modeling_auto (which imports it): while modeling_auto is
    # still being executed, registering would import it half-made, so its own hook registers instead
    if name == CONFIGURATION_AUTO and MODELING_AUTO in sys.modules:
        return
    register()


class _Loader(importlib.abc.Loader):
    """The real loader of an Auto module, then :func:`_loaded`."""

    def __init__(self, loader, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _loaded(self.name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the two Auto modules with the other finders and wraps their loaders."""

    def find_spec(self, name, path, target=None):
        if name not in (CONFIGURATION_AUTO, MODELING_AUTO):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


def install() -> None:
    """Register now if ``transformers``' Auto classes are loaded, else when they load (once per process)."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    if MODELING_AUTO in sys.modules or CONFIGURATION_AUTO in sys.modules:
        register()
        return
    sys.meta_path.insert(0, _Finder())
