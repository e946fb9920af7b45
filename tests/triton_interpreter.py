"""Make Triton's interpreter skip a repeated, no-op set-up on every call of a ``@triton.jit`` helper.

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language`` once (every builtin is replaced
by its NumPy version for the launch, and restored after it). Triton 3.x's interpreter then patches again
on every call of a device function from inside the kernel (``InterpretedFunction.__call__`` calls
``_patch_lang``), walking every member of the language modules with ``inspect.getmembers``. Inside a
running launch that second pass finds nothing left to replace, since the builtins are already the
patched versions, yet in this project's kernels, which call small helpers inside their chunk loops, it is
about 40% of the interpreter's time.

:func:`skip_repeated_patching` wraps the interpreter's ``_patch_lang``: a launch patches as before and
records which language modules it patched; a device-function call made during that launch is patched
as Triton does it the first time it sees a module not yet patched (``triton.language.core``, which
``tl.sum`` and the other functions of ``triton.language.standard`` see), and not again: Triton never
restores those nested patches, so they hold for the rest of the launch. Results do not change; only the
time does. ``BL_TEST_STOCK_TRITON_INTERPRETER=1`` leaves the interpreter as
Triton ships it (to compare, or if a future Triton changes these internals; the wrapper then also
leaves it alone when the names it needs are missing).
"""

from __future__ import annotations

import inspect


def skip_repeated_patching(environ) -> bool:
    """Install the wrapper once; return whether it is installed (False: stock interpreter, by request, or
    Triton missing or shaped differently)."""
    if environ.get("BL_TEST_STOCK_TRITON_INTERPRETER") == "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "_bl_skips_repeats", False):
        return patch is not None
    if not all(hasattr(interpreter, name) for name in ("GridExecutor", "InterpretedFunction")):
        return False

    launches: list[set[int]] = []  # per running launch: the language modules patched during it

    # id of a function's globals -> (the globals, kept so that the id stays theirs; the language modules among them)
    seen: dict[int, tuple[dict, frozenset[int]]] = {}

    def langs_of(fn) -> frozenset[int]:
        # a module's globals name its imports at import: walked once per module, not on every call (walking them
        # on every call was about a tenth of the interpreter's time in the scan tests)
        scope = fn.__globals__
        if id(scope) not in seen:
            langs = frozenset(id(v) for v in scope.values() if inspect.ismodule(v) and v in (tl, tl.core))
            seen[id(scope)] = scope, langs
        return seen[id(scope)][1]

    class _LaunchScope:
        """The launch's own scope; restoring it also ends the launch's record."""

        def __init__(self, scope):
            self._scope = scope

        def restore(self):
            try:
                self._scope.restore()
            finally:
                launches.pop()

    class _NothingToRestore:
        def restore(self):
            pass

    launch_code = interpreter.GridExecutor.__call__.__code__
    device_call_code = interpreter.InterpretedFunction.__call__.__code__

    def patch_lang(fn):
        caller = inspect.currentframe().f_back.f_code
        if caller is launch_code:
            scope = patch(fn)
            launches.append(set(langs_of(fn)))
            return _LaunchScope(scope)
        if caller is device_call_code and launches:
            # a device-function call inside a launch: Triton patches the modules it sees and never restores
            # that scope, so they stay patched for the rest of the launch (and after); patch each once
            langs = langs_of(fn)
            if langs <= launches[-1]:
                return _NothingToRestore()
            launches[-1] |= langs
        return patch(fn)

    patch_lang._bl_skips_repeats = True
    patch_lang.stock = patch
    interpreter._patch_lang = patch_lang
    return True
