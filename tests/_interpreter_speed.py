"""Triton's interpreter, faster for kernels built from many small @triton.jit helpers.

Each launch (``GridExecutor.__call__``) patches ``triton.language`` for the interpreter and
restores it at the end. Each call of a ``@triton.jit`` helper from inside the kernel
(``InterpretedFunction.__call__``) patches it again, with ``inspect.getmembers`` over
``tl``, ``tl.tensor`` and ``tl.math`` each time, and drops the result: while the launch's
patches are in place that second pass changes nothing (the builtins are already wrapped; the
rest is set to equivalent values). Our kernels call helpers per key tile (the tutorial's
style), so that pass was about a third of the suite's interpreter time.

``install()`` skips a helper's pass while the language modules it sees were patched during the
running launch: by the launch's own pass, or by an earlier helper's (Triton's own helpers, e.g.
``tl.cdiv``, see ``tl.core`` under another name; their pass is not undone until the process
ends, so it holds for the rest of the launch). Where the interpreter's internals differ from
what this expects (another Triton), nothing is changed.

``sanitize_overflow(on)`` turns the interpreter's int32 overflow check on or off. The
interpreter's default does the check's work and drops it: every int32 add / sub / mul of a
kernel is redone in int64 and compared with the int32 range (about a third of a kernel test's
interpreter time), but the assertion is emitted only with ``debug=True``. Off, neither runs (as
in a compiled kernel); on, both, so an overflow raises. The suite runs with it off (conftest)
and the slow stage runs the kernel tests with it on (``tests/test_interpreter_speed.py``).
"""
import dataclasses
import inspect

# set to "1", the suite runs with the int32 overflow check on (conftest reads it)
SANITIZE_OVERFLOW_ENV = "TXL_TESTS_SANITIZE_OVERFLOW"
_state = {"pending": False, "langs": None}


class _NoScope:
    def restore(self) -> None:
        pass


_LANGS = {}  # id(function globals) -> the ids of the language modules in them


def _langs(fn, lang_modules) -> frozenset:
    g = fn.__globals__
    got = _LANGS.get(id(g))
    if got is None or got[0] is not g:
        got = _LANGS[id(g)] = (g, frozenset(id(v) for v in g.values() if inspect.ismodule(v)
                                            and any(v is m for m in lang_modules)))
    return got[1]


def install() -> bool:
    """Hook the interpreter (idempotent); False where its internals are not the expected."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    grid = getattr(interp, "GridExecutor", None)
    patch = getattr(interp, "_patch_lang", None)
    if getattr(patch, "_txl_hooked", False):
        return True
    if grid is None or patch is None or not hasattr(interp, "InterpretedFunction"):
        return False
    lang_modules = (tl, tl.core)
    run = grid.__call__

    def patch_lang(fn):
        langs = _langs(fn, lang_modules)
        if _state["langs"] is not None and langs <= _state["langs"]:
            return _NoScope()  # a helper inside a launch whose patches are in place
        scope = patch(fn)
        if _state["pending"]:  # the launch's own pass
            _state["pending"], _state["langs"] = False, langs
        elif _state["langs"] is not None:  # a helper's pass: in place for the launch's rest
            _state["langs"] = _state["langs"] | langs
        return scope

    def launch(self, *args, **kwargs):
        _state["pending"], _state["langs"] = True, None
        try:
            return run(self, *args, **kwargs)
        finally:
            _state["pending"], _state["langs"] = False, None

    patch_lang._txl_hooked = True
    patch_lang.original = patch  # the interpreter's own (tests/test_interpreter_speed.py)
    interp._patch_lang = patch_lang
    grid.__call__ = launch
    return True


def sanitize_overflow(on: bool) -> bool:
    """Turn the interpreter's int32 overflow check on (the check and its assertion: options
    ``sanitize_overflow`` and ``debug``) or off (neither); False where this Triton's interpreter
    keeps its options elsewhere (then nothing is changed)."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not (dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow")
            and hasattr(options, "debug")):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=bool(on), debug=bool(on))
    return True
