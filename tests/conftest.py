import course_utils  # noqa: F401, I001  (chooses the mode, and sets TRITON_INTERPRET before any kernel exists)

import collections  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402



# ---- Triton's interpreter without its repeated patching (pinned Triton 3.6 only) --------------------------
# Under TRITON_INTERPRET=1 a launch patches triton.language's builtins to interpreted ones (_patch_lang),
# runs the grid and restores them. Every call of a @triton.jit helper from inside the kernel calls
# _patch_lang again, walking every member of tl, tl.tensor and tl.math with inspect.getmembers: ~3 ms a
# call, a quarter of the CPU time of the course's interpreted kernels (profiled on the attention and
# hand-step checkers' tests). Inside a launch that already patched the modules a helper sees, that call
# changes nothing: the builtins are patched already (it skips them), and it sets the same attributes to
# equivalent new closures, whose scope it never restores (the launch's own scope restores the originals).
# So here a helper's call inside a launch that patched every module it sees is skipped; any other call
# (a launch's own, a helper that sees a module the launch did not patch) runs as before. The kernels'
# arithmetic, the grid and the checks are unchanged. COURSE_TEST_PLAIN_INTERPRETER=1 turns it off.
def _skip_repeated_interpreter_patching() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("COURSE_TEST_PLAIN_INTERPRETER") == "1":
        return
    import inspect
    import threading

    import triton
    import triton.language as tl
    if not triton.__version__.startswith("3.6."):   # read for 3.6 alone: another release runs untouched
        return
    from triton.runtime import interpreter as interp
    launch, patch = interp.GridExecutor.__call__, interp._patch_lang
    state = threading.local()   # per thread: the module sets patched by the launches running now

    def seen(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_once(fn):
        stack = getattr(state, "stack", None)
        if stack and stack[-1] is not None and seen(fn) <= stack[-1]:
            return interp._LangPatchScope()   # patched by this launch already: nothing to do, nothing to restore
        scope = patch(fn)
        if stack:
            stack[-1] = seen(fn) | (stack[-1] or frozenset())
        return scope

    def launch_tracked(self, *args, **kwargs):
        stack = state.__dict__.setdefault("stack", [])
        stack.append(None)   # the launch's own _patch_lang fills it
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    interp._patch_lang, interp.GridExecutor.__call__ = patch_once, launch_tracked


_skip_repeated_interpreter_patching()

@pytest.fixture(scope="module")
def gpu_check(request):
    """``tools/gpu_checks/<TOOL>.py`` loaded as a module, ``TOOL`` named by the test module: the tests of a GPU
    check run its kernels under the interpreter, so that a GPU run times right kernels only."""
    import importlib.util
    from pathlib import Path

    name = request.module.TOOL
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "tools" /
                                                  "gpu_checks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def nan_empty(monkeypatch):
    """Every floating torch.empty / empty_like / empty_strided / new_empty / new_empty_strided starts as NaN: an
    element no kernel wrote shows (shared by the tests of the course's ops)."""
    def poison(fn):
        def wrapped(*args, **kwargs):
            t = fn(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return wrapped
    monkeypatch.setattr(torch, "empty", poison(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poison(torch.empty_like))
    monkeypatch.setattr(torch, "empty_strided", poison(torch.empty_strided))
    monkeypatch.setattr(torch.Tensor, "new_empty", poison(torch.Tensor.new_empty))
    monkeypatch.setattr(torch.Tensor, "new_empty_strided", poison(torch.Tensor.new_empty_strided))


# ---- make test-gpu: the longest tests first, spread over the workers' shares -----------------------------
# pytest-xdist's worksteal hands each worker a contiguous share of the collected tests and later lets
# idle workers steal from the end of the longest queue. A test of two or three minutes that sits deep
# in a share starts late and sets the end of the run; two tests that compile the same kernels in two
# workers at once compile them twice. So on a GPU host these groups go first, dealt to the shares'
# heads longest first, one a share a round, the rounds alternating in direction (the 17th longest
# joins the 16th), and the tests of a group run one after another in one process, where the kernels
# the first one compiled and the tile choice it timed are in memory for the rest.
# Seconds: the tests phase of make test-gpu on an H200 from a cold Triton cache, 16 workers, one torch
# thread a worker (results/h200/test_gpu_times_s21.tsv.gz, code 634844d), longest first.
# Only the order changes, never a check.
_GRADE = "tests/test_grading.py::test_solution_passes_every_check[{}.ipynb]"
_EVERY_TILE = "tests/test_gemm.py::test_gpu_every_candidate[{}]"
_AR_TUNED = "tests/test_allreduce_tuned.py::test_tuned_one_shot_survives_the_checkers_adversarial_schedule[{}]"
_AR_FAULT = "tests/test_allreduce_checkers.py::test_each_fault_is_named[{}-reads before the wait]"
_ATTN_FULL = "tests/test_attention_backward.py::test_gpu_full_sizes[({})-torch.{}]"
_CLASS = "tests/test_grade_class.py::test_{}"
GPU_HEAVY = (
    (_GRADE.format("13_across_gpus"),),                                                        # 178 s
    (_GRADE.format("10_layernorm"),),                                                          # 109 s
    ("tests/test_allreduce_checkers.py::test_right_kernels_pass",),                            # 108 s
    (_AR_TUNED.format("True"), _AR_TUNED.format("False")),                                     # 69 s + 36 s
    ("tests/test_allreduce.py::test_teaching_kernels_survive_the_adversarial_schedule",),       # 100 s
    (_GRADE.format("09_gemm_epilogue"),),                                                      # 89 s
    # one module-scoped fixture grades the class once for all three: apart, three workers would grade it
    (_CLASS.format("recipe_exits_zero_and_writes_csv_junit_report"),
     _CLASS.format("wrong_broken_and_tampered_fail_with_reasons"),
     _CLASS.format("honest_students_pass_everything")),                                        # 79 s
    (_AR_FAULT.format("fused"),),                                                              # 79 s
    (_ATTN_FULL.format("1, 8, 1, 500, 1100, 96, True", "float16"),
     _ATTN_FULL.format("1, 8, 1, 500, 1100, 96, True", "bfloat16")),                           # 42 s + 40 s
    (_EVERY_TILE.format("dtype1-4096-16384-4096"),),                                           # 76 s
    (_EVERY_TILE.format("dtype0-4096-16384-4096"),),                                           # 75 s
    (_EVERY_TILE.format("dtype1-333-520-264"),),                                               # 69 s
    (_GRADE.format("07_flash_attention"),),                                                    # 68 s
    (_ATTN_FULL.format("2, 8, 8, 1024, 1024, 128, True", "float16"),
     _ATTN_FULL.format("2, 8, 8, 1024, 1024, 128, True", "bfloat16")),                         # 38 s + 27 s
    ("tests/test_elementwise.py::test_cuda_cpp_version_says_why_it_is_unavailable",),          # 65 s
    (_EVERY_TILE.format("dtype0-333-520-264"),),                                               # 62 s
    (_ATTN_FULL.format("1, 16, 4, 777, 777, 80, True", "float16"),
     _ATTN_FULL.format("1, 16, 4, 777, 777, 80, True", "bfloat16")),                           # 32 s + 31 s
    ("tests/test_hand_step_checker.py::test_right_block_backward_passes",),                    # 60 s
    (_GRADE.format("04_gelu"),),                                                               # 58 s
    (_ATTN_FULL.format("1, 8, 2, 1100, 500, 128, True", "float16"),
     _ATTN_FULL.format("1, 8, 2, 1100, 500, 128, True", "bfloat16")),                          # 31 s + 27 s
    (_AR_FAULT.format("all-reduce"),),                                                         # 48 s
    ("tests/test_visible_ops.py::test_the_compiled_gpt_launches_the_course_kernels_itself",),  # 48 s
    (_GRADE.format("11_backward_and_training"),),                                              # 46 s
    (_GRADE.format("12_training_step"),),                                                      # 41 s
    ("tests/test_integrity.py::test_honest_student_calling_course_check_passes",),             # 33 s
    ("tests/test_grading.py::test_untouched_exercise_fails_every_check[12_training_step.ipynb]",),  # 30 s
    ("tests/test_grade.py::test_cell_that_never_returns_times_out",),                          # 29 s
    (_GRADE.format("05_softmax"),),                                                            # 28 s
)


def worksteal_shares(n_items: int, workers: int) -> list[int]:
    """How many tests worksteal first sends each worker: the pending tests split evenly, in order."""
    sizes, left = [], n_items
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def heavy_first(items: list, workers: int, heavy=GPU_HEAVY) -> list:
    """``items`` reordered so that the groups of ``heavy`` (node ids, longest first) open the workers'
    shares, dealt one a share a round, each round in the other direction; every other test keeps its
    relative order."""
    by_id = {item.nodeid: item for item in items}
    groups = [g for g in ([by_id[n] for n in group if n in by_id] for group in heavy) if g]
    heads: list[list] = [[] for _ in range(workers)]
    for k, group in enumerate(groups):
        rnd, pos = divmod(k, workers)
        heads[pos if rnd % 2 == 0 else workers - 1 - pos] += group
    placed = {id(item) for group in groups for item in group}
    rest = iter([item for item in items if id(item) not in placed])
    out = []
    for head, size in zip(heads, worksteal_shares(len(items), workers)):
        out += head + list(itertools.islice(rest, max(0, size - len(head))))
    return out + list(rest)


# ---- COURSE_PARAM_SAMPLE=k: every k-th parameter set of each parametrized test, and its last --------------
# tools/triton_next.sh runs the CPU unit tests a second time under the newest Triton, as a canary for an
# upgrade that breaks the course: there every test function still runs, on a third of its parameter sets
# (the first, every third, the last), since a Triton change that breaks a kernel or the interpreter's
# hooks breaks it on any of them. The pinned Triton's run (make test) runs every parameter set.
def sample_params(keys: list, k: int) -> list[bool]:
    """For the test functions ``keys`` (one key per item, in collection order), which items to keep:
    of each function's items, the 0th, k-th, 2k-th ... and the last."""
    if k < 1:
        raise ValueError(f"COURSE_PARAM_SAMPLE must be an integer >= 1, got {k}")
    count, seen = collections.Counter(keys), collections.Counter()
    keep = []
    for key in keys:
        i = seen[key]
        seen[key] += 1
        keep.append(i % k == 0 or i == count[key] - 1)
    return keep


def _function_key(item) -> tuple:
    return item.nodeid.split("[", 1)[0], getattr(item, "originalname", item.name)


@pytest.hookimpl(trylast=True)  # after -m deselects: the sample and the shares are of the tests that run
def pytest_collection_modifyitems(config, items):
    k = os.environ.get("COURSE_PARAM_SAMPLE")
    if k:
        keep = sample_params([_function_key(item) for item in items], int(k))
        dropped = [item for item, kept in zip(items, keep) if not kept]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item, kept in zip(items, keep) if kept]
    workers = getattr(config, "workerinput", {}).get("workercount")  # set in pytest-xdist's workers only
    if workers and course_utils.env.on_gpu():
        items[:] = heavy_first(items, int(workers))


# Each xdist worker's torch takes every core for its CPU ops by default: 16 workers on 16 cores ran 256 threads,
# and the checkers' float64 references and fault diagnoses then took 3-4x their time alone (tools/compile_census.py's
# author measured chapter 7's bug6 diagnosis: 22 s against 7.4 s at 16 threads a core). So a worker keeps its share
# of the cores on a GPU host (COURSE_TEST_THREADS sets another count anywhere). Not under the interpreter: on CI's
# 2 cores a capped run of two files took 70 s against 60 uncapped (one try, a busy machine). The results do not
# depend on it beyond float rounding that the tolerances already allow (a reduction's order follows the threads).
def pytest_configure(config):
    workers = getattr(config, "workerinput", {}).get("workercount")
    threads = os.environ.get("COURSE_TEST_THREADS")
    if threads or (workers and course_utils.env.on_gpu()):
        torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // int(workers)))


# COURSE_TEST_TIMES=<file>: the seconds of each phase of each test (setup, call, teardown) appended to <file>
# as it ends, one "seconds<TAB>phase<TAB>node id<TAB>outcome" line, by every xdist worker: a run stopped by a time limit
# still leaves what it timed (pytest's --durations prints only at the end). tools/test_times.py sums it.
_TIMES = os.environ.get("COURSE_TEST_TIMES")


def pytest_runtest_logreport(report):
    # under xdist the controller gets every worker's report again (with .node set): the worker wrote it
    if _TIMES and getattr(report, "node", None) is None:
        with open(_TIMES, "a") as f:   # one short line a write: workers' lines do not interleave
            f.write(f"{report.duration:.3f}\t{report.when}\t{report.nodeid}\t{report.outcome}\n")
