"""Multi-process CPU harness: a pool of gloo ranks (DeepSpeed's comm) that run test functions.

Starting a rank costs seconds (torch + DeepSpeed imports, process-group setup), so a
``DistPool`` starts ``world_size`` processes once and runs many test functions on them::

    pool = DistPool(2)
    results = pool.run(fn, arg1, arg2)   # fn(*args) on every rank; [result of rank 0, ...]
    pool.close()

``fn`` must be a module-level function (it is pickled by reference). If any rank raises, the
pool is closed (its peers may be stuck in a collective) and ``run`` raises with every failing
rank's traceback; the next ``run`` starts a fresh pool.

DeepSpeed's CPU backend compiles its ``deepspeed_shm_comm`` extension in
``init_distributed``; two ranks compiling it at once can fail ("No such file or directory"),
so ``build_shm_comm()`` compiles it once in the parent before any rank starts.

Below the pool: the MoE builders and the fake-quantized DeepSpeed reference that the MoE
tests (test_moe_layer.py, test_moe_dist.py) share.
"""

import contextlib
import os
import queue
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp
from pathlib import Path

_BUILT = False
# Seconds a rank waits in a collective before gloo gives up (a peer failed), and that the
# parent waits for one test function on all ranks.
COLLECTIVE_TIMEOUT_S = 90
RUN_TIMEOUT_S = 240


def cpu_env():
    """Environment every DeepSpeed CPU process needs (also set in the parent)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def eager_triton_ops():
    """DeepSpeed's Triton ops (AutoEP's fused SwiGLU) off in these CPU ranks.

    DeepSpeed 0.19.8 picks ``deepspeed/ops/triton_ops/swiglu_triton.py``'s kernel whenever
    a GPU is present, whatever device the tensors are on; on a GPU machine the CPU tensors
    of these gloo ranks then fail ("Pointer argument cannot be accessed from Triton"). Its
    eager fallback is what a CPU-only machine runs.
    """
    from deepspeed.ops.triton_ops import swiglu_triton
    swiglu_triton._TRITON_AVAILABLE = False


def build_shm_comm():
    """Compile (or load from the torch extensions cache) DeepSpeed's shm_comm op, once."""
    global _BUILT
    if not _BUILT:
        cpu_env()
        from deepspeed.accelerator import get_accelerator
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            builder.load(verbose=False)
        _BUILT = True


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, tasks, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cpu_env()
    torch.set_num_threads(1)
    import deepspeed
    eager_triton_ops()
    try:
        deepspeed.init_distributed(dist_backend="gloo", verbose=False,
                                   timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    except BaseException:  # e.g. the port was taken between _free_port and the bind
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report everything, including assertion failures
            results.put((rank, False, traceback.format_exc()))


class DistPool:
    """``world_size`` CPU ranks with DeepSpeed's comm initialized (gloo), running tasks."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs = []

    def _start(self, attempts=3):
        """Start the ranks and wait until all joined the process group; a free port can be
        taken by another process before rank 0 binds it, so a failed start is retried on a
        new port."""
        build_shm_comm()
        ctx = mp.get_context("spawn")
        for attempt in range(attempts):
            port = self._port = _free_port()
            self._results = ctx.Queue()
            self._tasks = [ctx.Queue() for _ in range(self.world_size)]
            self._procs = [ctx.Process(target=_worker, daemon=True,
                                       args=(r, self.world_size, port, self._tasks[r],
                                             self._results))
                           for r in range(self.world_size)]
            for p in self._procs:
                p.start()
            failure = self._wait_ready()
            if failure is None:
                return
            self.close()
            if attempt == attempts - 1:
                raise AssertionError(f"the {self.world_size} ranks did not start:\n{failure}")

    def _wait_ready(self):
        """None once every rank reported ready, else the first failure's traceback."""
        ready = 0
        while ready < self.world_size:
            try:
                _, ok, value = self._results.get(timeout=RUN_TIMEOUT_S)
            except queue.Empty:
                return "no rank reported within the timeout"
            if not ok:
                return value
            ready += 1
        return None

    def run(self, fn, *args, timeout=RUN_TIMEOUT_S):
        """Run ``fn(*args)`` on every rank; return the results ordered by rank."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        got, failures = {}, []
        while len(got) < self.world_size:
            try:  # once a rank failed, its peers may wait in a collective: do not wait long
                rank, ok, value = self._results.get(timeout=10 if failures else timeout)
            except queue.Empty:
                self.close()
                missing = sorted(set(range(self.world_size)) - set(got))
                raise AssertionError(f"{fn.__name__}: ranks {missing} did not finish\n"
                                     + "\n".join(failures)) from None
            got[rank] = value
            if not ok:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            self.close()
            raise AssertionError(f"{fn.__name__} failed on {len(failures)} rank(s):\n"
                                 + "\n".join(failures))
        return [got[r] for r in range(self.world_size)]

    def close(self):
        """Stop the ranks (politely, then by terminating the ones this pool started)."""
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._procs = []
        _unlink_shm_buffers(getattr(self, "_port", None))


def _unlink_shm_buffers(port):
    """Remove the shared-memory all-reduce buffers DeepSpeed's shm_comm made for the ranks
    on ``port`` (``moe_train.launch.unlink_shm_buffers``). They outlive the processes; each
    pool left ~130 MB in /dev/shm, and leftovers of earlier runs filled it on a 24 GB machine
    until the compiler was killed for memory."""
    if port is None:
        return
    tools = str(REPO / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from moe_train.launch import unlink_shm_buffers
    unlink_shm_buffers("127.0.0.1", port)


# ---- MoE models and the fake-quantized DeepSpeed reference, shared by the MoE tests ----

class Contiguous(torch.nn.Module):
    """``x -> x.contiguous()`` (see ``mlp_expert``)."""

    def forward(self, x):
        return x.contiguous()


def mlp_expert(hidden, ffn, contiguous_input=False):
    """Linear -> GELU -> Linear (biases on).

    ``contiguous_input``: first make the input contiguous. DeepSpeed hands each expert a
    non-contiguous chunk and CPU bf16 matmuls round differently on such views than on a
    contiguous copy; FP4MoE's chunks are contiguous. With this, both layers multiply
    contiguous tensors, so a bit-exact comparison tests the formats, not memory layouts.
    """
    layers = [torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden)]
    if contiguous_input:
        layers.insert(0, Contiguous())
    return torch.nn.Sequential(*layers)


def make_moe(hidden=128, ffn=256, num_experts=4, ep_size=1, k=1, drop_tokens=True,
             dtype=None, seed=0, expert=None, parallel=True, ep_rank=0, **moe_kwargs):
    """A ``deepspeed.moe.layer.MoE`` whose experts have weights set by their global id.

    Every rank builds the same gate; local expert j of expert-parallel rank r gets the
    weights of global expert ``r * n_local + j`` (so a token sent to the wrong expert shows).
    ``parallel``: call ``set_deepspeed_parallelism`` (needs an initialized process group)
    and take r from it; else r is ``ep_rank`` (for models a DeepSpeed engine will set up).
    Returns the layer in ``dtype`` (default fp32).
    """
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups
    torch.manual_seed(seed)
    moe_kwargs.setdefault("min_capacity", 4)
    layer = MoE(hidden, expert if expert is not None else mlp_expert(hidden, ffn),
                num_experts=num_experts, ep_size=ep_size, k=k, drop_tokens=drop_tokens,
                **moe_kwargs)
    if parallel:
        layer.set_deepspeed_parallelism()
        ep_rank = groups._get_expert_parallel_rank(layer.expert_group_name)
    n_local = layer.num_local_experts
    with torch.no_grad():
        for j, ex in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(1000 * (seed + 1) + ep_rank * n_local + j)
            for p in ex.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return layer.to(dtype) if dtype is not None else layer


def fake_quant(x, fmt, rounding="rceil"):
    """``x`` rounded through ``fmt`` ("mxfp4" | "fp8" | "bf16") and back, in x's dtype.

    Built from the non-row ops (``quantize_mxfp4``/``quantize_fp8``), not from the layer's
    wire packing, so that the reference does not share the code under test.
    """
    from ds_fp4 import ops
    fmt = str(fmt)
    if fmt == "mxfp4":
        return ops.dequantize_mxfp4(*ops.quantize_mxfp4(x, rounding), x.dtype)
    if fmt == "fp8":
        flat = x.reshape(-1, x.shape[-1])
        return ops.dequantize_fp8(*ops.quantize_fp8(flat), x.dtype).view(x.shape)
    return x.to(torch.bfloat16).to(x.dtype)


def route_format(cfg):
    """The format FP4 layers keep the routes' outputs in for a full ``fp4_moe`` dict (the
    rule of ``ds_fp4.moe.cache.route_output_format``, hidden a multiple of 128): fp8 where
    z's format is mxfp4 or fp8, else None (not taken over)."""
    z = cfg.get("activation_cache") or cfg["cache"]
    return "fp8" if z in ("mxfp4", "fp8") else None


@contextlib.contextmanager
def kept_rows(owner, name, fmt, rounding, size_of, dtype=None):
    """``owner.name`` with every tensor it saves at one ``[n, m]`` size, in ``dtype`` (its
    first argument's when None), rounded through ``fmt``: the specification of
    ``ds_fp4.moe.cache.RowsCache``. ``size_of(*args)``: ``(n, m)`` of the call."""
    original = getattr(owner, name)
    own = name in vars(owner)   # a module's function, or an instance's bound method

    def call(first, *args, **kwargs):
        n, m = size_of(first, *args)

        def pack(t):
            if t.dtype == (dtype or first.dtype) and t.shape[-1] == m and t.numel() == n * m:
                return fake_quant(t.reshape(n, m), fmt, rounding).view(t.shape)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return original(first, *args, **kwargs)

    setattr(owner, name, call)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)   # back to the class's method


def kept_route_outputs(module, name, fmt, rounding, routes_of):
    """``kept_rows`` for a combine: the routes' outputs, ``routes_of(expert_output, *args)``
    rows of the output's width."""
    return kept_rows(module, name, fmt, rounding,
                     lambda out, *args: (routes_of(out, *args), out.shape[-1]))


class FakeQuantAllToAll:
    """Test-only stand-in for DeepSpeed's ``_AllToAll``: quantize, send, dequantize.

    Patched over ``deepspeed.moe.sharded_moe._AllToAll`` it turns DeepSpeed's own layer into
    the specification of FP4MoE: the forward calls alternate dispatch, combine (``reset()``
    before each forward); gradients go through ``grad``'s format. With ``cache``, the
    routes' outputs DeepSpeed's decode keeps for the gates' gradient are rounded through it.
    """

    def __init__(self, dispatch, combine, grad, rounding="rceil", cache=None):
        import torch
        import torch.distributed as tdist
        self.formats = (dispatch, combine)
        self.calls = 0
        self.cache, self.rounding = cache, rounding

        class _Fn(torch.autograd.Function):

            @staticmethod
            def forward(ctx, group, x, fmt):
                ctx.group = group
                y = fake_quant(x.contiguous(), fmt, rounding).contiguous()
                out = torch.empty_like(y)
                tdist.all_to_all_single(out, y, group=group)
                return out

            @staticmethod
            def backward(ctx, g):
                y = fake_quant(g.contiguous(), grad).contiguous()
                out = torch.empty_like(y)
                tdist.all_to_all_single(out, y, group=ctx.group)
                return None, out, None

        self._fn = _Fn

    def reset(self):
        self.calls = 0

    def apply(self, group, x):
        fmt = self.formats[self.calls % 2]
        self.calls += 1
        return self._fn.apply(group, x, fmt)


def forward_backward(layer, x, seed, grad_out=None, fake=None):
    """Run ``layer`` on a leaf copy of ``x`` with the RNG at ``seed``; backprop ``grad_out``.

    Returns ``(output, l_aux, x.grad, {param name: grad})``; ``fake``: a ``FakeQuantAllToAll``
    to patch over DeepSpeed's ``_AllToAll`` for this call.
    """
    from deepspeed.moe import sharded_moe
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    saved = sharded_moe._AllToAll
    keep = contextlib.nullcontext()
    if fake is not None:
        fake.reset()
        sharded_moe._AllToAll = fake
        if fake.cache is not None:
            keep = kept_route_outputs(sharded_moe, "_sparse_decode", fake.cache, fake.rounding,
                                      lambda out, slots, *_: slots.numel())
    try:
        torch.manual_seed(seed)
        with keep:
            out, l_aux, _ = layer(x)
        if grad_out is None:
            grad_out = torch.ones_like(out)
        torch.autograd.backward((out, l_aux), (grad_out.to(out.dtype), torch.ones_like(l_aux)))
    finally:
        sharded_moe._AllToAll = saved
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), l_aux.detach(), x.grad.detach(), grads


def saved_bytes(layer, x, seed=None):
    """Bytes of the distinct storages autograd keeps after ``layer``'s forward on a leaf copy
    of ``x`` (the RNG at ``seed`` when given).

    Counted through an outer ``saved_tensors_hooks``, to which the ds_fp4 caches pass what
    they keep. The hook holds every saved tensor until the count is done: a storage saved by
    a node that dies during the forward could otherwise be freed and its address reused by a
    later one, which would replace its entry (a count that varied from run to run).
    """
    storages, held = {}, []

    def pack(t):
        held.append(t)
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if seed is not None:
            torch.manual_seed(seed)
        layer(x.detach().clone().requires_grad_(True))
    return sum(storages.values())


def checkpointed_output(layer, x, mode=None):
    """``layer(x)[0]`` run as is (``mode`` None), under ``torch.utils.checkpoint``
    (non-reentrant, ``"torch"``) or under ``deepspeed.checkpointing`` (``"deepspeed"``)."""
    run = (lambda t: layer(t)[0])
    if mode == "torch":
        return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
    if mode == "deepspeed":
        import deepspeed
        return deepspeed.checkpointing.checkpoint(run, x)
    return run(x)


def rel_err(a, b):
    """``||a - b|| / ||b||`` in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den else (a - b).norm().item()


REPO = Path(__file__).resolve().parent.parent
# A one-layer main job that trains in seconds on 2 CPU ranks (tests of tools/train_moe.py).
TINY_TRAIN_ARGS = ["--deepspeed_config", str(REPO / "ds_config_examples" / "fp4_moe.json"),
                   "--layers", "1", "--hidden", "128", "--heads", "4", "--experts", "4",
                   "--ffn", "128", "--seq-len", "64", "--micro-batch", "8",
                   "--eval-batches", "2", "--eval-interval", "0", "--no-progress"]


def rank():
    """This pool worker's rank in the default process group."""
    import torch.distributed as tdist
    return tdist.get_rank()
