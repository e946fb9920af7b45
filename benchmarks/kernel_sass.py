"""What a call launches, compiled for sm_90, and what its SASS says (no GPU needed).

Three steps, used by ``benchmarks/gpu.py --compile-only --default-path`` (the census) and by
``benchmarks/cost_model.py`` (per-step latencies from the compiled kernels):

1. :func:`record_launches` runs a call (BL's default path, fla's GDN) in Triton's interpreter with every kernel
   launch *recorded and skipped*: for each launch the kernel, its grid and what Triton's JIT would compile for an
   ``sm_90`` GPU (signature, constexprs, 16-byte alignment attributes, options such as ``num_warps``), computed from
   the launch's own arguments with the JIT's own argument binder.  Nothing runs, so a call at T = 32k costs only
   its host-side PyTorch ops.  Autotuned kernels launch with their first config (fla's, pinned).
2. :func:`compile_launch` compiles one recorded launch for ``sm_90`` in a process without the interpreter
   (``triton.compile``, as ``JITFunction.run`` would) and disassembles it (``cuobjdump`` shipped with Triton).
3. :func:`parse_sass` reads ``cuobjdump -sass`` output: every instruction with its control word (stall cycles,
   scoreboards set and waited on), and the loop tree; :func:`census_row` counts instruction families.

The recording runs in a child process (``python benchmarks/kernel_sass.py --record-json JOBS``) because the interpreter
is switched on per process.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARCH = 90


# ---------------------------------------------------------------------------------------------------------------
# 1. recording launches (child process, TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(y) for y in x]
    return {"repr": repr(x)}


def _counting_range(kernel_name: str, counts: dict):
    """A ``range`` for a kernel module's globals while one of its kernels runs in the interpreter: a loop of the
    kernel itself (``kernel_name``'s frame) whose bound is a runtime value (an interpreter tensor, not a
    constexpr int) adds its calls and iterations to ``counts[line]``."""
    import builtins

    def counting_range(*a):
        r = builtins.range(*a)
        if any(hasattr(x, "handle") for x in a):
            f = sys._getframe(1)
            if f.f_code.co_name == kernel_name:
                c = counts.setdefault(f.f_lineno, [0, 0])
                c[0] += 1
                c[1] += len(r)
        return r

    return counting_range


@contextlib.contextmanager
def _recording(launches: list, arch: int = ARCH, execute: bool = False):
    """Within the block every interpreted kernel launch is appended to ``launches`` (as JSON-able dicts) and
    skipped, or with ``execute`` run, each record then carrying ``steps``: iterations per program of the kernel's
    outermost runtime loop (the first such loop in its source; None without one), counted as it runs (a string
    saying why when the interpreter cannot run the kernel, which is then skipped)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binders: dict = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return None
        fn = self.fn
        if fn not in binders:
            opts = {k: v for k, v in self.kwargs.items()
                    if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
            jit = JITFunction(fn, **opts)
            binders[fn] = (jit, create_function_from_signature(jit.signature, jit.params, backend))
        jit, binder = binders[fn]
        kw = {k: v for k, v in kwargs.items()}
        kw.setdefault("debug", False)
        bound, specialization, options = binder(*args, **kw)
        options, signature, constexprs, attrs = jit._pack_args(backend, kw, bound, specialization, options)
        given = grid
        if callable(grid):
            grid = grid(bound)
        grid = [int(g) for g in (tuple(grid) + (1, 1, 1))[:3]]
        launches.append({
            "kernel": fn.__name__, "module": fn.__module__, "grid": grid,
            "signature": {k: v for k, v in signature.items()},
            "constexprs": [[list(p), _jsonable(v)] for p, v in constexprs.items()],
            "attrs": [[list(p), _jsonable(v)] for p, v in attrs.items()],
            "options": {k: _jsonable(v) for k, v in vars(options).items() if k in
                        ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion",
                         "launch_cooperative_grid", "default_dot_input_precision", "extern_libs")},
            "triton": triton.__version__,
            "arg_bytes": sum(a.numel() * a.element_size() for a in bound.values() if hasattr(a, "element_size")),
        })
        if execute:
            counts: dict = {}
            g = fn.__globals__
            had, prev = "range" in g, g.get("range")
            g["range"] = _counting_range(fn.__name__, counts)
            try:
                with _uncounted():
                    original(self, *args, grid=given, warmup=warmup, **kwargs)
                launches[-1]["steps"] = counts[min(counts)][1] / max(1, _prod(grid)) if counts else None
            except Exception as e:  # a kernel the interpreter cannot run (fla's fwd_h): skipped as below
                launches[-1]["steps"] = "not run: " + repr(e)[:200]
            finally:
                if had:
                    g["range"] = prev
                else:
                    del g["range"]
            if not isinstance(launches[-1]["steps"], str):
                return None
        # skipped: what it would have written is left benign (every floating-point tensor argument 0.5: a
        # positive-definite-enough state for the host-side code after it, whose values nobody reads)
        with _uncounted():
            for a in bound.values():
                if hasattr(a, "is_floating_point") and a.is_floating_point():
                    a.fill_(0.5)
        return None

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


_COUNTING = [True]


def _prod(g) -> int:
    return g[0] * g[1] * g[2]


@contextlib.contextmanager
def _uncounted():
    _COUNTING[0] = False
    try:
        yield
    finally:
        _COUNTING[0] = True


def _op_counter(counts: list):
    """A dispatch mode appending the name of every PyTorch op that would launch work (not views, not metadata)
    to ``counts``: what the host queues besides the Triton launches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket.__name__)
            if _COUNTING[0] and not any(t in name for t in ("view", "expand", "detach", "alias", "as_strided",
                                                               "_unsafe", "t", "transpose", "permute", "unsqueeze",
                                                               "squeeze", "slice", "select", "lift", "is_", "size",
                                                               "stride", "numel", "dim", "_to_copy_noop")):
                counts.append(name)
            return out

    return Count()


@contextlib.contextmanager
def _peak_bytes(out: dict, key: str, measure: bool = True):
    """``out[key]``: the most bytes the block held allocated at once above what was allocated before it (the
    CPU allocator's allocations and frees as PyTorch's profiler records them, in time order) — with every launch
    skipped, what the call's host code allocates, as on a GPU (whose caching allocator rounds each block up to
    512 bytes).  ``measure`` False: nothing measured."""
    if not measure:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield
    events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e[0])  # stable: ties keep the recorded order
    held = peak = 0
    for _, n in events:
        held += n
        peak = max(peak, held)
    out[key] = peak


def _inputs(B, T, H, D, dtype, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen) / D ** 0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    alpha = 0.9 + 0.1 * torch.rand(B, T, H, generator=gen)
    r2 = 0.1 + torch.rand(B, T, H, generator=gen)
    ell2 = 0.01 + 0.05 * torch.rand(B, T, H, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), alpha=alpha, r2=r2, ell2=ell2, beta=beta)


def _bl_call(x, backward: bool):
    """BL's default path as a user calls it: ``bl_chunk(..., backend="triton")`` (value checks off, as when
    training), then ``.backward()`` of every leaf when ``backward``."""
    import torch

    from bayeslayer.ops import bl_chunk, set_value_checks

    set_value_checks(False)
    leaves = {n: x[n].detach().requires_grad_(backward) for n in ("q", "k", "v", "r2", "ell2", "alpha")}
    with torch.set_grad_enabled(backward):
        o = bl_chunk(*(leaves[n] for n in ("q", "k", "v", "r2", "ell2", "alpha")), backend="triton")[0]
        if backward:
            o.backward(torch.ones_like(o))


def _gdn_call(x, backward: bool):
    """fla's ``chunk_gated_delta_rule`` (g = log α, β), forward and, with ``backward``, its backward."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g = torch.log(x["alpha"])
    leaves = {"q": x["q"], "k": x["k"], "v": x["v"], "g": g, "beta": x["beta"].to(x["q"].dtype)}
    leaves = {n: t.detach().requires_grad_(backward) for n, t in leaves.items()}
    with torch.set_grad_enabled(backward):
        o = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=1.0)[0]
        if backward:
            o.backward(torch.ones_like(o))


CALLS = {"bl": _bl_call, "gdn": _gdn_call}


@contextlib.contextmanager
def _sms(n: int | None):
    """The SM count the dispatch sees on this CPU (``DEFAULT_SMS`` of every ``bayeslayer.ops`` module that has
    one), so that a call at fewer heads makes the choices it makes at more heads on the whole GPU."""
    if n is None:
        yield
        return
    saved = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("bayeslayer.ops") and mod is not None and isinstance(getattr(mod, "DEFAULT_SMS", None), int):
            saved.append((mod, mod.DEFAULT_SMS))
            mod.DEFAULT_SMS = n
    try:
        yield
    finally:
        for mod, v in saved:
            mod.DEFAULT_SMS = v


@contextlib.contextmanager
def _segments(n: int | None):
    """The segment scan splits every sequence into ``n`` segments (``bayeslayer.ops.bayesian_layer.scan``'s
    ``choose_segment_chunks`` answers ``ceil(chunks / n)``): a call recorded at a short T then makes the choice the
    dispatch makes at the full shape, computed there by that same function."""
    if n is None:
        yield
        return
    from bayeslayer.ops.bayesian_layer import scan

    original = scan.choose_segment_chunks

    def fixed(n_programs, n_chunks, T, *, sms=scan.DEFAULT_SMS):
        return -(-max(n_chunks, 1) // n)

    scan.choose_segment_chunks = fixed
    try:
        yield
    finally:
        scan.choose_segment_chunks = original


@contextlib.contextmanager
def _path(path: str | None):
    """The dispatch runs covariance pass ``path`` (``"chain"`` or ``"scan"``) whatever ``covariance_path`` would
    choose for the recorded shape: a call recorded at one head and a few chunks then launches what the dispatch
    chooses at the full shape, where that same function is asked."""
    if path is None:
        yield
        return
    from bayeslayer.ops.bayesian_layer import chunk_triton

    original = chunk_triton.covariance_path
    chunk_triton.covariance_path = lambda *a, **kw: path
    try:
        yield
    finally:
        chunk_triton.covariance_path = original


@contextlib.contextmanager
def _fla_launches_behind_twins(execute: bool = True):
    """fla's ``fwd_h`` and ``bwd_dhu`` do not run in Triton's interpreter, so on a CPU BL's mean pass computes
    with their PyTorch twins (``mean_pass_fla.TWIN_KERNELS``), which launch nothing.  Within the block each twin
    first calls fla's own function on copies of its arguments — its launch is recorded (and skipped, or fails to
    run) as on a GPU, with fla's host work counted — and then computes the result, its PyTorch ops not counted
    (a GPU runs fla's kernel instead).  Without ``execute`` (every launch skipped) fla's own function runs on the
    arguments themselves and its outputs are the result, as on a GPU: then the call allocates what it allocates
    there."""
    from bayeslayer.ops.bayesian_layer import mean_pass_fla as mpf

    def behind(name, twin):
        import importlib

        real = getattr(importlib.import_module(mpf.FLA_BACKWARD_KERNELS[name]), name)
        if not execute:
            return real

        def call(*args, **kwargs):
            with _uncounted():
                copy = [a.clone() if hasattr(a, "clone") else a for a in args]
                kcopy = {k: v.clone() if hasattr(v, "clone") else v for k, v in kwargs.items()}
            try:
                real(*copy, **kcopy)
            except Exception:  # its launch is recorded before it fails; what follows it on the host is not
                pass
            with _uncounted():
                return twin(*args, **kwargs)

        return call

    saved_ref, saved = mpf.fwd_h_reference, dict(mpf.TWIN_KERNELS)
    for name in mpf.NOT_INTERPRETABLE:
        mpf.TWIN_KERNELS[name] = behind(name, saved[name])
    mpf.fwd_h_reference = mpf.TWIN_KERNELS["chunk_gated_delta_rule_fwd_h"]
    try:
        yield
    finally:
        mpf.fwd_h_reference = saved_ref
        mpf.TWIN_KERNELS.clear()
        mpf.TWIN_KERNELS.update(saved)


def record_in_process(which: str, B: int, T: int, H: int, D: int, dtype: str = "bf16", backward: bool = False,
                      sms: int | None = None, segments: int | None = None, execute: bool = False,
                      path: str | None = None) -> dict:
    """The launches of one call (:data:`CALLS`), in launch order, recorded in this process (which must have
    ``TRITON_INTERPRET=1`` set before Triton was imported).  Forward launches are tagged ``phase: "fwd"``, the
    backward's ``"bwd"``.  ``sms``: the SM count the dispatch sees; ``segments``: the segment count the scan uses
    (:func:`_segments`); ``execute``: run the kernels and count their chunk-loop steps (:func:`_recording`);
    ``path``: the covariance pass BL's dispatch runs (:func:`_path`; None: its own choice)."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("record_in_process needs TRITON_INTERPRET=1 (use record_launches)")
    if which not in CALLS:
        raise ValueError(f"which must be one of {tuple(CALLS)}, got {which!r}")
    import bayeslayer.ops  # noqa: F401  (so that _sms finds the dispatch's modules)
    from bayeslayer.ops.bayesian_layer import mean_pass_fla

    torch.set_num_threads(1)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    x = _inputs(B, T, H, D, dt)
    fwd: list = []
    ops_f: list = []
    ops_fb: list = []
    modules = ("fla.ops.gated_delta_rule", *mean_pass_fla.FLA_MODULES)
    twins = _fla_launches_behind_twins(execute) if which == "bl" else contextlib.nullcontext()
    peak: dict = {}
    with _sms(sms), _segments(segments), _path(path), twins, mean_pass_fla.one_autotune_config(modules):
        with _recording(fwd, execute=execute), _op_counter(ops_f), _peak_bytes(peak, "fwd", not execute):
            CALLS[which](x, False)
        allx: list = []
        if backward:
            with _recording(allx, execute=execute), _op_counter(ops_fb), _peak_bytes(peak, "fwdbwd", not execute):
                CALLS[which](x, True)
    for r in fwd:
        r["phase"] = "fwd"
    # the forward+backward call repeats the forward's launches first (autograd's forward), then the backward's
    bwd = allx[len(fwd):] if [r["kernel"] for r in allx[:len(fwd)]] == [r["kernel"] for r in fwd] else allx
    for r in bwd:
        r["phase"] = "bwd"
    return {"launches": fwd + bwd, "torch_ops_fwd": len(ops_f), "torch_ops_fwdbwd": len(ops_fb) if backward else None,
            "peak_bytes_fwd": peak.get("fwd"), "peak_bytes_fwdbwd": peak.get("fwdbwd")}


def _child_env() -> dict:
    return dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def record_launches(which: str, B: int, T: int, H: int, D: int, dtype: str = "bf16", backward: bool = False,
                    sms: int | None = None, python: str | None = None) -> dict:
    """:func:`record_in_process` in a child process with ``TRITON_INTERPRET=1`` (``python``: its interpreter,
    default this one): ``{"launches": [...], "torch_ops_fwd": n, "torch_ops_fwdbwd": n or None}``."""
    job = dict(which=which, B=B, T=T, H=H, D=D, dtype=dtype, backward=backward, sms=sms)
    return record_many([job], python)[0]


def record_many(jobs: list[dict], python: str | None = None) -> list[dict]:
    """Several :func:`record_in_process` calls (keyword dicts) in one child process (one import of Triton, fla and
    the package for all of them), results in order."""
    cmd = [python or sys.executable, str(Path(__file__).resolve()), "--record-json", json.dumps(jobs)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_child_env())
    done = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or len(done) != len(jobs):
        err = RecordingError(f"recording {jobs[len(done)]} failed: {res.stderr.strip()[-3000:]}")
        err.done = done
        raise err
    return done


class RecordingError(RuntimeError):
    """A job of :func:`record_many` failed; ``done``: the results of the jobs before it."""

    done: list


# ---------------------------------------------------------------------------------------------------------------
# 2. compiling a recorded launch (no interpreter)
# ---------------------------------------------------------------------------------------------------------------

def _jit_of(module: str, name: str):
    """The ``JITFunction`` named ``name`` in ``module`` (through autotuner / heuristics wrappers)."""
    from triton.runtime.jit import JITFunction

    obj = getattr(importlib.import_module(module), name)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{module}.{name} is not a Triton kernel (is TRITON_INTERPRET set in this process?)")
    return obj


def _value(v):
    if isinstance(v, dict) and "repr" in v:
        raise ValueError(f"cannot rebuild constexpr {v['repr']}")
    return v


def triton_bin(tool: str) -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    if not path.is_file():
        raise FileNotFoundError(f"{tool} not found beside Triton ({path})")
    return path


def compile_launch(launch: dict, arch: int = ARCH) -> dict:
    """Compile one recorded launch for ``sm_<arch>``: ``{"sass", "ttgir", "shared_bytes", "num_warps",
    "resources", "triton"}`` (``sass``: ``cuobjdump -sass`` text, ``resources``: its ``-res-usage`` line)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_launch needs a process without TRITON_INTERPRET=1")
    jit = _jit_of(launch["module"], launch["kernel"])
    constexprs = {tuple(p): _value(v) for p, v in launch["constexprs"]}
    # recorded under the interpreter, a kernel's ``INTERP`` flag is True; on a GPU the dispatch passes False
    # (``_interpreting()``), and that is the kernel compiled here
    if "INTERP" in jit.arg_names and (jit.arg_names.index("INTERP"),) in constexprs:
        constexprs[(jit.arg_names.index("INTERP"),)] = False
    attrs = {tuple(p): [tuple(a) for a in v] for p, v in launch["attrs"]}
    src = ASTSource(jit, dict(launch["signature"]), constexprs, attrs)
    opts = {k: v for k, v in launch["options"].items() if v is not None and k != "extern_libs"}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(triton_bin("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(triton_bin("cuobjdump")), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    return {"sass": sass, "ttgir": compiled.asm["ttgir"], "shared_bytes": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps, "triton": triton.__version__,
            "resources": next((ln.strip() for ln in usage.splitlines() if "REG" in ln), "")}


def launch_key(launch: dict) -> str:
    """What makes two launches the same compiled kernel."""
    return json.dumps([launch["module"], launch["kernel"], launch["signature"], launch["constexprs"], launch["attrs"],
                       launch["options"]], sort_keys=True)


# ---------------------------------------------------------------------------------------------------------------
# 3. reading SASS
# ---------------------------------------------------------------------------------------------------------------

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_HI = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_TARGET = re.compile(r"`?\(\.L_x_(\d+)\)`?|0x([0-9a-f]+)")


@dataclass
class Insn:
    """One SASS instruction: address, opcode (with modifiers), operands text, guard predicate, and the control
    word of Volta-and-later encodings (bits 105-125 of the 128-bit instruction; Jia et al. 2018, "Dissecting the
    NVIDIA Volta GPU Architecture via Microbenchmarking", §2.1): stall cycles before the next instruction may
    issue, the scoreboard (0-5) this instruction's result releases (write) or its sources release (read), and
    the scoreboards it waits on before issuing."""

    addr: int
    op: str
    operands: str
    pred: str
    stall: int
    write_sb: int | None
    read_sb: int | None
    wait: tuple
    target: int | None = None  # branch target address

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


def _control(hi: int) -> tuple:
    c = (hi >> 41) & 0x7FFFFF
    stall, wr, rd, wait = c & 0xF, (c >> 5) & 7, (c >> 8) & 7, (c >> 11) & 0x3F
    return stall, (None if wr == 7 else wr), (None if rd == 7 else rd), tuple(b for b in range(6) if wait >> b & 1)


def parse_sass(text: str) -> list[Insn]:
    """The instructions of one kernel's ``cuobjdump -sass`` text (the first function in it), with branch targets
    resolved to addresses."""
    if not isinstance(text, str):
        raise TypeError("text must be cuobjdump -sass output (str)")
    lines = text.splitlines()
    out: list[Insn] = []
    labels: dict[int, int] = {}
    i = 0
    while i < len(lines):
        m = _INSN.match(lines[i])
        if m and i + 1 < len(lines) and _HI.match(lines[i + 1]):
            addr, body = int(m.group(1), 16), m.group(2)
            hi = int(_HI.match(lines[i + 1]).group(1), 16)
            pred = ""
            pm = re.match(r"^(@!?U?P[T0-9]+)\s+(.*)$", body)
            if pm:
                pred, body = pm.group(1), pm.group(2)
            parts = body.split(None, 1)
            op, operands = parts[0], (parts[1] if len(parts) > 1 else "")
            stall, wr, rd, wait = _control(hi)
            ins = Insn(addr, op, operands, pred, stall, wr, rd, wait)
            if ins.base in ("BRA", "BRX", "JMP", "CALL", "BSSY", "BREAK", "BRK"):
                t = re.search(r"0x([0-9a-f]+)", operands)
                if t:
                    ins.target = int(t.group(1), 16)
            out.append(ins)
            i += 2
            continue
        i += 1
    del labels
    if not out:
        raise ValueError("no SASS instructions found (is this cuobjdump -sass output?)")
    return out


@dataclass
class Loop:
    """A natural loop of the SASS: ``head`` .. ``tail`` (instruction indices, the tail is the back-edge branch),
    its child loops, and its trip count (None: a runtime count, i.e. the chunk loop)."""

    head: int
    tail: int
    children: list = field(default_factory=list)
    trips: int | None = None

    def contains(self, other: Loop) -> bool:
        return self.head <= other.head and other.tail <= self.tail and self is not other


def loop_tree(insns: list[Insn]) -> list[Loop]:
    """Top-level loops (with children), from the backward branches."""
    index = {ins.addr: i for i, ins in enumerate(insns)}
    loops = []
    for i, ins in enumerate(insns):
        if ins.base == "BRA" and ins.target is not None and ins.target <= ins.addr and ins.target in index:
            if index[ins.target] == i:  # the trap loop at the end (BRA to itself)
                continue
            loops.append(Loop(index[ins.target], i))
    loops.sort(key=lambda lp: (lp.head, -lp.tail))
    merged: list[Loop] = []
    for lp in loops:  # two back edges to one head: one loop up to the last
        same = next((m for m in merged if m.head == lp.head), None)
        if same:
            same.tail = max(same.tail, lp.tail)
        else:
            merged.append(lp)
    roots: list[Loop] = []
    for lp in sorted(merged, key=lambda x: (x.head, -x.tail)):
        parent = None
        stack = list(roots)
        while stack:
            cand = stack.pop()
            if cand.contains(lp):
                parent = cand
                stack = list(cand.children)
        (parent.children if parent else roots).append(lp)
    return roots


_FOR = re.compile(r"scf\.for\s+%\S+\s*=\s*%(\S+)\s+to\s+%(\S+)\s+step\s+%(\S+)")
_CONST = re.compile(r"%(\S+)\s*=\s*arith\.constant\s+(-?\d+)\s*:\s*i(?:32|64)")


def ttgir_loop_tree(ttgir: str) -> list:
    """The ``scf.for`` loops of a kernel's TTGIR as nested ``[trips or None, children]`` lists (None: bounds
    not constant, the runtime chunk loop), in program order."""
    consts = {m.group(1): int(m.group(2)) for m in _CONST.finditer(ttgir)}
    roots: list = []
    stack: list = []  # (depth of braces when opened, node)
    depth = 0
    for line in ttgir.splitlines():
        m = _FOR.search(line)
        if m:
            lo, hi, st = (consts.get(m.group(j)) for j in (1, 2, 3))
            trips = -(-(hi - lo) // st) if None not in (lo, hi, st) and st > 0 else None
            node = [trips, []]
            (stack[-1][1][1] if stack else roots).append(node)
            stack.append((depth, node))
        depth += line.count("{") - line.count("}")
        while stack and depth <= stack[-1][0]:
            stack.pop()
    return roots


def _shape(tree) -> list:
    return [_shape(c) for c in (tree.children if isinstance(tree, Loop) else tree[1])]


def assign_trips(sass_roots: list[Loop], ttgir_roots: list, strict: bool = False) -> bool:
    """Trip counts of the SASS loops from the TTGIR's ``scf.for`` bounds, matched in program order.  Returns True
    when the two loop trees have the same shape; otherwise (a loop unrolled or split by the backend; ``strict``:
    raise) the counts are matched approximately (below) and it returns False."""
    if [_shape(r) for r in sass_roots] != [_shape(r) for r in ttgir_roots]:
        if strict:
            raise ValueError(f"SASS loop tree {[_shape(r) for r in sass_roots]} differs from the TTGIR's "
                             f"{[_shape(r) for r in ttgir_roots]}")
        # the backend unrolled or split a loop: the outermost SASS loop gets the runtime bound when the TTGIR has
        # one, the others the TTGIR's constant trip counts in program order (a missing one: 1)
        def pre(nodes, acc):
            for n in nodes:
                acc.append(n)
                pre(n.children if isinstance(n, Loop) else n[1], acc)
            return acc

        s_all, t_all = pre(sass_roots, []), pre(ttgir_roots, [])
        runtime = any(t[0] is None for t in t_all)
        consts = [t[0] for t in t_all if t[0] is not None]
        for i, lp in enumerate(s_all):
            if runtime and lp in sass_roots and i == 0:
                lp.trips = None
            else:
                lp.trips = consts.pop(0) if consts else 1
        return False

    def walk(a: Loop, b: list):
        a.trips = b[0]
        for x, y in zip(a.children, b[1], strict=True):
            walk(x, y)

    for a, b in zip(sass_roots, ttgir_roots, strict=True):
        walk(a, b)
    return True


# SASS opcode families counted by the census: the tensor-core matrix instructions (HMMA: fp16/bf16/tf32
# mma.sync, HGMMA: Hopper's warpgroup wgmma, DMMA: float64, IMMA: integer) against the scalar multiply-adds on
# the CUDA cores (FFMA fp32, DFMA float64) and the plain fp32/fp64 multiplies and adds
SASS_FAMILIES = {"tensor_core": ("HMMA", "HGMMA", "DMMA", "IMMA", "QGMMA", "IGMMA", "BGMMA"),
                 "FFMA": ("FFMA",), "DFMA": ("DFMA",), "FMUL_FADD": ("FMUL", "FADD"), "DMUL_DADD": ("DMUL", "DADD")}


def sass_census(sass: str, resources: str = "") -> dict:
    """Static instruction counts of one kernel's SASS by :data:`SASS_FAMILIES`, the tensor-core opcodes one by
    one, and registers / local-memory stack (spills, bytes) from ``cuobjdump -res-usage``'s line.  A loop body
    counts once."""
    if not isinstance(sass, str) or not isinstance(resources, str):
        raise TypeError("sass and resources must be str (cuobjdump's output)")
    ops: dict[str, int] = {}
    for ins in parse_sass(sass):
        ops[ins.base] = ops.get(ins.base, 0) + 1
    return opcode_census(ops, resources)


def opcode_census(ops: dict[str, int], resources: str = "") -> dict:
    """The census of one kernel from its opcode counts ``{base opcode: count}``: the counts by
    :data:`SASS_FAMILIES`, the total, the tensor-core opcodes one by one, and registers / local-memory stack
    (spills, bytes) from ``cuobjdump -res-usage``'s line (None where the line does not say)."""
    out = {f"sass_{fam}": sum(ops.get(o, 0) for o in names) for fam, names in SASS_FAMILIES.items()}
    out["sass_total"] = sum(ops.values())
    out["sass_tensor_core_ops"] = {o: ops[o] for o in SASS_FAMILIES["tensor_core"] if ops.get(o)}
    for key, name in (("REG", "registers"), ("STACK", "spill_bytes")):
        m = re.search(rf"\b{key}:(\d+)", resources)
        out[name] = int(m.group(1)) if m else None
    return out


#: what fla's hardware queries answer on an H200 (sm_90): the device properties Triton's driver reports
H200_PROPERTIES = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


def import_fla_as_on_h200() -> None:
    """Import flash-linear-attention with its device queries answering as an H200 does.

    fla chooses at import, from the device (``fla.utils.hardware``), its warp lists, tile sizes, autotune configs
    and the TF32 dot precision of GDN's kernels, and at call time tile sizes from the shared memory
    (``check_shared_mem``) and grids from the SM count; on a CPU it takes its no-GPU branches (IEEE dots, 32-wide
    tiles, one SM).  Within this function Triton's driver reports an sm_90 target with
    :data:`H200_PROPERTIES` and ``torch.cuda`` an "NVIDIA H200" of capability (9, 0) while ``fla`` is imported;
    afterwards both answer as before, except the two call-time queries fla keeps (shared memory per device, SM
    count), which keep the H200's answers, and fla's Hopper guard is bypassed as the device line bypasses it.
    The recorded launches then carry what fla launches on an H200."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    if "fla" in sys.modules:
        raise RuntimeError("fla is already imported: import_fla_as_on_h200 must run before anything imports it")

    class _Utils:
        @staticmethod
        def get_device_properties(index):
            return dict(H200_PROPERTIES)

    class _Driver:
        utils = _Utils()

        @staticmethod
        def get_current_target():
            return GPUTarget("cuda", 90, 32)

    cuda = torch.cuda
    saved = {n: getattr(cuda, n) for n in ("get_device_name", "get_device_capability", "device_count")}
    cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.device_count = lambda *a, **k: 1
    config = triton.runtime.driver
    saved_active = config._active  # None on a CPU: reset_active would look for a driver and fail
    config.set_active(_Driver())
    try:
        import fla  # noqa: F401
        import fla.utils.hardware as hw

        hw.get_multiprocessor_count(0)  # cached with the H200's answer
    finally:
        config._active = saved_active
        for n, f in saved.items():
            setattr(cuda, n, f)
    hw.get_all_max_shared_mem = lambda: [H200_PROPERTIES["max_shared_mem"]]
    # fla then refuses its gated backward on Hopper with Triton < 3.7.1 (its issue #640): bypassed, as the device
    # line runs it (benchmarks/gpu_session.sh, docs/kernels.md "fla's Hopper guard")
    from bayeslayer.ops.bayesian_layer.mean_pass_fla import fla_hopper_guard

    fla_hopper_guard(bypass=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record-json"] and len(argv) == 2:
        import_fla_as_on_h200()
        for job in json.loads(argv[1]):
            print(json.dumps(record_in_process(**job)), flush=True)
        return 0
    print("usage: kernel_sass.py --record-json JOBS (a child process of record_many)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
