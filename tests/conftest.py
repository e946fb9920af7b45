"""Shared pytest set-up: deterministic seeds, and a hypothesis profile sized for a 2-core CI machine."""

from __future__ import annotations

import atexit
import gc
import os

import pytest


def pin_fp32_dot_precision(environ, cuda: bool) -> str | None:
    """On a GPU, pin the default precision of fp32 ``tl.dot`` to IEEE for the whole session; return it (None: left
    alone, as on the CPU, where the interpreter multiplies in fp32 anyway).

    Our kernels name their precision; flash-linear-attention's (the mean pass, GDN) leave it to Triton, whose
    default for fp32 operands on tensor-core GPUs is TF32 (10-bit mantissa): tests that compare fla's fp32 path
    with float64 at 1e-5 would measure TF32 rounding, not the code.  ``TRITON_F32_DEFAULT`` is not part of Triton's
    cache key, so a kernel compiled under another default would be reused from the cache: unless the caller chose
    a cache, the session gets one of its own per default."""
    if not cuda:
        return None
    value = environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if "TRITON_CACHE_DIR" not in environ:
        environ["TRITON_CACHE_DIR"] = os.path.join(os.path.expanduser("~"), ".triton", f"cache-f32-{value}")
    return value


def one_thread_per_worker(environ) -> None:
    """Under pytest-xdist, give each worker one intra-op thread (and its child processes one OpenMP thread);
    outside a worker, leave the thread count alone.

    Each worker would otherwise start as many threads as the machine has cores, so two workers on two cores
    run four busy threads that wait on each other; tests compare results, never thread counts, and the
    bit-identical checks compare runs made under the same setting."""
    if "PYTEST_XDIST_WORKER" in environ:
        import torch

        environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)


def bypass_fla_hopper_guard(environ) -> dict | None:
    """With ``BL_TEST_BYPASS_FLA_HOPPER_GUARD=1`` (the device check sets it), switch off fla's refusal of its gated
    backward on Hopper with Triton < 3.7.1 (fla issue #640), so that the tests check those kernels' values instead
    of stopping at the refusal; returns what :func:`bayeslayer.ops.bayesian_layer.mean_pass_fla.fla_hopper_guard`
    reports (None: not asked)."""
    if environ.get("BL_TEST_BYPASS_FLA_HOPPER_GUARD") != "1":
        return None
    from bayeslayer.ops.bayesian_layer.mean_pass_fla import fla_hopper_guard

    return fla_hopper_guard(bypass=True)


# what :func:`session_setup` chose, once it has run: the keys ``fp32_dot``, ``fla_guard``, ``fast_calls``
SETUP: dict = {}


def session_setup() -> dict:
    """Set up the process that runs tests (once; the choices it made are returned and kept in :data:`SETUP`).

    Triton reads TRITON_INTERPRET once, when it is first imported, and flash-linear-attention (the test oracle)
    imports it early; so the whole session must agree before any test module loads.  Without a GPU the Triton
    kernels can only run in the interpreter."""
    if not SETUP:
        import torch

        cuda = torch.cuda.is_available()
        if not cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        fp32_dot = pin_fp32_dot_precision(os.environ, cuda)
        one_thread_per_worker(os.environ)
        fast_calls = False
        if os.environ.get("TRITON_INTERPRET") == "1":
            from .triton_interpreter import skip_repeated_patching

            fast_calls = skip_repeated_patching(os.environ)
        SETUP.update(fp32_dot=fp32_dot, fla_guard=bypass_fla_hopper_guard(os.environ), fast_calls=fast_calls)
        gc.freeze()  # torch and Triton live on (see below)
    return SETUP


@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which registers its "dsession" when this process distributes
def pytest_configure(config):
    """Every process that runs or collects tests is set up before it imports a test module.  pytest-xdist's
    controller only hands test files to its workers (each sets itself up): it skips the set-up, and with it
    importing torch and Triton (about 1.5 s of CPU)."""
    if config.pluginmanager.getplugin("dsession") is None:
        session_setup()


def pytest_report_header(config):
    setup = session_setup()
    return [f"fp32 tl.dot default: {setup['fp32_dot'] or 'Triton default (not pinned)'}; fla Hopper guard: "
            f"{setup['fla_guard'] if setup['fla_guard'] is not None else 'left alone'}; Triton interpreter: "
            f"{'device-function calls skip re-patching' if setup['fast_calls'] else 'as shipped'}"]

# The garbage collector's full passes walk every object that lives on: after torch, transformers and fla are imported
# that is over half a million objects, and a full pass about every 70,000 allocations (Python's default thresholds)
# cost about a fifth of collecting the suite and a tenth of running it.  What is alive once a test file has been
# imported or run (modules, their functions and constants) stays alive, so it is moved out of the collector's reach
# (``gc.freeze``); garbage made by tests is still collected as before, and a full pass after each file frees what that
# file left in reference cycles before the rest is frozen.  The youngest generation is collected every 20,000
# allocations instead of 700: most objects (the Triton interpreter's, autograd's) die by reference count long before
# that, and the collector stops re-scanning the survivors of every test that many times.
gc.freeze()
gc.set_threshold(20_000, 10, 10)
atexit.register(gc.unfreeze)  # at exit, objects are freed as usual (extension modules report those left over)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    yield
    if isinstance(collector, pytest.Module):
        gc.freeze()


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if nextitem is None or nextitem.path != item.path:  # the last test of a file: its module fixtures are torn down
        gc.collect()
        gc.freeze()


try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test extra; the property tests skip themselves without it
    settings = None

if settings is not None:
    # No per-example deadline: the first example pays for torch's lazy initialisation, and the
    # shared CI cores make wall-clock times noisy.  Examples are few (10, hypothesis's own default is 100);
    # each draws a whole sequence, and the thorough profile below runs 500.
    settings.register_profile(
        "bayeslayer", deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow]
    )
    # On demand: `pytest --hypothesis-profile=bayeslayer-thorough tests/ops/test_properties.py`.
    settings.register_profile(
        "bayeslayer-thorough", parent=settings.get_profile("bayeslayer"), max_examples=500
    )
    settings.load_profile("bayeslayer")


@pytest.fixture(autouse=True)
def _seed_and_restore_value_checks():
    """Every test starts from the same RNG state with value checks on, whatever a previous test did."""
    import torch

    from bayeslayer.ops import set_value_checks

    torch.manual_seed(0)
    previous = set_value_checks(True)
    yield
    set_value_checks(previous)


@pytest.fixture
def no_opt_einsum():
    """Three-operand einsums contracted left to right, as PyTorch does without the optional ``opt_einsum``
    package: the FLOP counts (``bayeslayer.ops.flops``) follow that order, and a machine that has the package
    would otherwise measure another contraction order."""
    import torch

    with torch.backends.opt_einsum.flags(enabled=False):
        yield


@pytest.fixture(scope="session")
def two_rank_job(tmp_path_factory):
    """The folder of the default suite's one two-rank gloo job (``tests/two_rank_job.py``), run once per test run:
    under pytest-xdist the workers share the folder above their own temporary folders."""
    from .two_rank_job import run_once

    base = tmp_path_factory.getbasetemp()
    return run_once(base.parent if "PYTEST_XDIST_WORKER" in os.environ else base)
