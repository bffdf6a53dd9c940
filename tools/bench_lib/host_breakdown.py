"""Where a step's host time goes, function by function, with little distortion.

cProfile times every Python call and C builtin, which on a host-bound MoE layer inflates the
step by ~40% and bends the picture towards many small calls. ``HostBreakdown`` instead wraps
only the functions and methods defined in the packages named (``ds_fp4``, DeepSpeed's MoE
modules) plus a few entry points (Triton's launcher, the autograd engine), each with two
``perf_counter`` reads. A call stack gives each function its own ("self") time, its
children's excluded, and its inclusive time. Autograd's C++ engine calls the Functions'
``backward`` staticmethods by attribute, so those are wrapped too; what the engine spends
between them shows as the self time of ``torch.autograd.backward``.

Use::

    with HostBreakdown(["ds_fp4", "deepspeed.moe"]) as hb:
        step()          # warm up wrapped: a function's identity can key a cache
        hb.reset()
        for _ in range(steps):
            step()
    rows = hb.table(steps)   # [(name, calls per step, self ms, inclusive ms per step)]
"""

import functools
import inspect
import sys
import time

_perf = time.perf_counter


class HostBreakdown:
    """Wrap the functions of ``packages`` (module name prefixes) while the context is open;
    ``extra``: more ``(owner, attribute name)`` pairs to wrap (module or class)."""

    def __init__(self, packages, extra=()):
        self.packages = tuple(packages)
        self.extra = list(extra)
        self.stats = {}       # name -> [calls, self seconds, inclusive seconds]
        self._stack = []      # per open call: [children's seconds]
        self._undo = []       # (owner, attribute, original value)
        self._wrappers = {}   # id(original function) -> wrapper (one per function)

    # ---- wrapping -------------------------------------------------------------------------

    def _ours(self, fn):
        mod = getattr(fn, "__module__", None) or ""
        return any(mod == p or mod.startswith(p + ".") for p in self.packages)

    def _wrapper(self, fn, name):
        hit = self._wrappers.get(id(fn))
        if hit is not None:
            return hit
        stats, stack = self.stats, self._stack

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stack.append(0.0)
            t0 = _perf()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = _perf() - t0
                children = stack.pop()
                if stack:
                    stack[-1] += spent
                entry = stats.get(name)
                if entry is None:
                    entry = stats[name] = [0, 0.0, 0.0]
                entry[0] += 1
                entry[1] += spent - children
                entry[2] += spent
        self._wrappers[id(fn)] = timed
        return timed

    def _patch(self, owner, attr, name):
        raw = inspect.getattr_static(owner, attr)
        if isinstance(raw, staticmethod):
            new = staticmethod(self._wrapper(raw.__func__, name))
        elif isinstance(raw, classmethod):
            return   # (none on the hot paths measured)
        elif inspect.isfunction(raw):
            new = self._wrapper(raw, name)
        else:
            return
        self._undo.append((owner, attr, raw))
        setattr(owner, attr, new)

    def _patch_module(self, mod):
        for attr, value in list(vars(mod).items()):
            if inspect.isfunction(value) and self._ours(value):
                self._patch(mod, attr, f"{value.__module__}.{value.__qualname__}")
            elif inspect.isclass(value) and value.__module__ == mod.__name__:
                for cattr, raw in list(vars(value).items()):
                    fn = raw.__func__ if isinstance(raw, staticmethod) else raw
                    if inspect.isfunction(fn) and not cattr.startswith("__"):
                        self._patch(value, cattr, f"{value.__module__}.{fn.__qualname__}")

    def __enter__(self):
        for name, mod in list(sys.modules.items()):
            if mod is not None and any(name == p or name.startswith(p + ".")
                                       for p in self.packages):
                self._patch_module(mod)
        for owner, attr in self.extra:   # (_patch skips what is not a function)
            self._patch(owner, attr, f"{getattr(owner, '__name__', owner)}.{attr}")
        return self

    def __exit__(self, *exc):
        for owner, attr, raw in reversed(self._undo):
            setattr(owner, attr, raw)
        self._undo.clear()

    def reset(self):
        """Forget what was counted so far (e.g. warm-up steps run with the wrappers on: a
        function's identity can key a cache, so warm up wrapped)."""
        self.stats.clear()

    # ---- results --------------------------------------------------------------------------

    def table(self, steps, top=60, by="self"):
        """``[(name, calls per step, self ms per step, inclusive ms per step)]``, the ``top``
        by ``by`` ("self" or "inclusive")."""
        col = 1 if by == "self" else 2
        rows = sorted(self.stats.items(), key=lambda kv: -kv[1][col])[:top]
        return [(name, calls / steps, s * 1e3 / steps, inc * 1e3 / steps)
                for name, (calls, s, inc) in rows]

    def text(self, steps, top=60):
        """Both tables as text."""
        out = []
        for by in ("self", "inclusive"):
            out.append(f"by {by} time, per step:  calls   self ms  incl. ms  function")
            for name, calls, s, inc in self.table(steps, top, by):
                out.append(f"{calls:9.1f} {s:9.3f} {inc:9.3f}  {name}")
            out.append("")
        return "\n".join(out)
