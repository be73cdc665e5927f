"""The vLLM internals engines/vllm_hooks.py relies on. These fail loudly, with what moved, on a vLLM upgrade:
re-check the hook named in the failure before changing the pin."""

from __future__ import annotations

import inspect
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines import vllm_hooks


def test_the_installed_vllm_is_the_pinned_one():
    vllm_hooks.check_version()


def test_the_scheduler_hooks_are_where_they_were():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    # schedule() reads spec_token_ids of running requests, and update_draft_token_ids overwrites them after a step
    src = inspect.getsource(Scheduler.schedule)
    assert "request.spec_token_ids" in src and "scheduled_spec_decode_tokens" in src
    assert "request.spec_token_ids" in inspect.getsource(Scheduler.update_draft_token_ids)
    params = list(inspect.signature(Scheduler.make_spec_decoding_stats).parameters)
    assert params == ["self", "spec_decoding_stats", "num_draft_tokens", "num_accepted_tokens",
                      "num_invalid_spec_tokens", "request_id"]
    assert "make_spec_decoding_stats" in inspect.getsource(Scheduler.update_from_output)
    init = inspect.getsource(Request.__init__)
    for attr in ("spec_token_ids", "num_computed_tokens", "max_tokens", "sampling_params"):
        assert f"self.{attr}" in init, attr
    assert isinstance(Request.num_tokens, property) and isinstance(Request.num_output_tokens, property)


def test_the_custom_class_proposer_path_is_where_it_was():
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    src = inspect.getsource(gpu_model_runner)
    assert 'method == "custom_class"' in src and "create_custom_proposer" in src
    assert "self.drafter.load_model(self.model)" in inspect.getsource(cpu_model_runner.CPUModelRunner.load_model)
    from vllm.v1.engine.core_client import InprocClient

    assert "self.engine_core" in inspect.getsource(InprocClient.__init__)  # the scheduler is reached through it


def rejection_sampling_bugs() -> str:
    """What fix_cpu_rejection_sampling works around, checked on vLLM's native CPU kernels as vLLM loads them
    (`current_platform.import_kernels()`: the AVX-512 or AVX2 build, whichever the CPU runs), never by importing one
    build by name."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only

    out = torch.full((6,), -7, dtype=torch.int32)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([3, 7, 5], dtype=torch.int32),
                                         torch.tensor([2, 5, 6], dtype=torch.int32), 0, 0)
    assert out.tolist() == [-7] * 6, "vLLM's expand now writes its output: remove expand_rows from the fix"
    try:
        getattr(apply_top_k_only, "__wrapped__", apply_top_k_only)(torch.zeros(0, 10),
                                                                   torch.zeros(0, dtype=torch.int32))
    except RuntimeError:
        return "both bugs still there"
    raise AssertionError("vLLM's top-k now takes zero rows: remove the empty-rows guard from the fix")


# The AVX2 build as a CPU without AVX-512 gets it, in a process of its own: loading it makes vLLM's ops that build's
# for the rest of the process (this one's are the native ones, which every in-process vLLM engine here loads too).
_AVX2 = """
import torch
torch.cpu._is_avx512_supported = lambda: False
from tests.test_vllm_hooks import rejection_sampling_bugs
print(rejection_sampling_bugs())
"""


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["native", "avx2"])
def test_the_cpu_rejection_sampling_bugs_are_still_there(kernels):
    """When this fails, vLLM fixed the bug it names: remove its fix from fix_cpu_rejection_sampling. `avx2`: vLLM's
    kernels as a CPU without AVX-512 gets them (this one runs them either way)."""
    if kernels == "native":
        assert rejection_sampling_bugs() == "both bugs still there"
        return
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("vLLM's AVX2 build is an x86-64 one")
    run = subprocess.run([sys.executable, "-c", _AVX2], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    assert "both bugs still there" in run.stdout


def test_a_step_without_drafts_takes_the_plain_sampler():
    """vllm_hooks.plain_sampler_without_drafts: vLLM's _sample still has its two branches (no metadata: the plain
    sampler; else the rejection sampler), the runner still builds metadata for draftless steps (the cost it
    removes), and the hook sends a step whose metadata holds no draft down the plain branch, any other to the
    rejection sampler."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner._sample)
    assert "if spec_decode_metadata is None:" in src and "return self.sampler(" in src
    assert "self.rejection_sampler(" in src
    assert "use_spec_decode = self.speculative_config is not None" in inspect.getsource(GPUModelRunner._prepare_inputs)
    vllm_hooks.plain_sampler_without_drafts()
    vllm_hooks.plain_sampler_without_drafts()  # idempotent: wrapped once
    assert not hasattr(GPUModelRunner._sample.__wrapped__, "no_draft_plain")
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(sampling_metadata="metadata", update_async_output_token_ids=lambda: None),
        use_async_scheduling=False, _draft_token_req_ids=None, _get_spec_decode_draft_probs=lambda m: None,
        sampler=lambda logits, sampling_metadata: "plain", rejection_sampler=lambda *a: "rejection")

    def metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
        return SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))

    logits = torch.zeros(2, 8)
    assert GPUModelRunner._sample(runner, logits, None) == "plain"
    assert GPUModelRunner._sample(runner, logits, metadata([[], []])) == "plain"
    assert GPUModelRunner._sample(runner, logits, metadata([[], [3, 4]])) == "rejection"


def test_the_cpu_seeded_partial_prefill_bug_is_still_there():
    """What vllm_hooks.fix_cpu_seeded_partial_prefill works around: sample_tokens rewinds the generators of the
    discarded (partly prefilled) requests by offset, which CPU generators refuse; the fix hides them from
    sample_tokens, whose sampling reads the input batch's generators by reference."""
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "gen.set_offset" in inspect.getsource(GPUModelRunner._bookkeeping_sync)
    src = inspect.getsource(GPUModelRunner.sample_tokens)
    assert "self._sample(" in src and "self._bookkeeping_sync(" in src
    assert "generators=self.generators" in inspect.getsource(InputBatch._make_sampling_metadata)
    with pytest.raises(RuntimeError, match="does not use offset"):
        torch.Generator().get_offset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_rows_repeats_each_requests_value_over_its_draft_rows(dtype):
    x = torch.tensor([3, 0, 5], dtype=dtype)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.empty(6, dtype=dtype)
    vllm_hooks.expand_rows(out, x, cu, 0, 1)
    assert out.tolist() == [3, 3, 1, 1, 1, 5]


def test_what_the_hooks_need_on_cuda_is_where_it_was_and_forced():
    """vLLM 0.32 keeps custom_class proposers off Model Runner V2 and async scheduling; the engine forces both
    where a user's settings would turn them on, and refuses settings that contradict them."""
    from vllm.config.vllm import VllmConfig

    src = inspect.getsource(VllmConfig)
    assert '"custom_class"' in src and "use_v2_model_runner" in src and "async_scheduling" in src
    with pytest.raises(ValueError, match="async_scheduling"):
        vllm_hooks.force_external_draft_support({"async_scheduling": True})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        with pytest.raises(ValueError, match="V2 model runner"):
            vllm_hooks.force_external_draft_support({})
        mp.delenv("VLLM_USE_V2_MODEL_RUNNER")
        vllm_hooks.force_external_draft_support({})
        import os

        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_sampling_params_give_vllm_what_min_tokens_holds_back():
    """`sampling_params` fills vLLM's private `_all_stop_token_ids`, what min_tokens holds back (vLLM fills it from
    its own stop ids and tokenizer, and the verifier's engine runs with neither: stops are ours). vLLM's rejection
    sampler applies min_tokens and the penalties to drafts, and refuses logit_bias and min_p with speculation."""
    from vllm.sampling_params import SamplingParams as VllmParams
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from engines.sampling import SamplingParams

    sp = vllm_hooks.sampling_params(SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[9], logprobs=2,
                                                   presence_penalty=0.5, frequency_penalty=0.2,
                                                   repetition_penalty=1.1), "ours", (0, 2))
    assert sp.all_stop_token_ids == {9, 0, 2} and not sp.stop_token_ids and sp.ignore_eos
    assert (sp.min_tokens, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.logprobs) == (
        3, 0.5, 0.2, 1.1, 2)
    assert "return self._all_stop_token_ids" in inspect.getsource(VllmParams.all_stop_token_ids.fget)
    assert "params.all_stop_token_ids" in inspect.getsource(MinTokensLogitsProcessor.add_request)
    # the engine adds to it (generation_config's EOS), and only trace replay, which we never ask for, empties it
    assert "self._all_stop_token_ids.add" in inspect.getsource(VllmParams.update_from_generation_config)
    assert "_all_stop_token_ids = set()" in inspect.getsource(InputProcessor._normalize_trace_replay_params)
    src = inspect.getsource(RejectionSampler.apply_logits_processors)
    assert "apply_with_spec_decode" in src and "apply_penalties" in src
    assert "logit_bias" in inspect.getsource(VllmParams._validate_spec_decode)


def test_no_code_imports_a_cpu_specific_native_build():
    """vLLM ships one native CPU build per instruction set (_C: AVX-512 with bf16, _C_AVX512, _C_AVX2) and picks
    the one the CPU runs; importing one by name aborts the interpreter on CPUs without its instructions (the suite
    died so on an AMD EPYC without AVX-512). Only vLLM's `current_platform.import_kernels()` may load them."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in root.rglob("*.py"):
        if any(part.startswith(".") or part in ("build", "node_modules") for part in path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module \
                else []
            found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                      if n.startswith("vllm._C") or n.startswith("vllm.vllm_flash_attn")]
    assert not found, found
