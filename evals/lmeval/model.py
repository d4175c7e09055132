"""lm-evaluation-harness model `ced`: a CED checkpoint scored on the inference-engine path.

    lm_eval --model ced --model_args checkpoint=/path/final,replay=32 ...      (see __main__)
    model_args: checkpoint (required), replay (N, W, W/k, kW, kW/d, R_exact, exact or none;
                default none = `full`; said with its N on stderr and in the results'
                config as ced_replay, e.g. 'W/2 -> 3'; above R_exact read as R_exact),
                turn + policy (+ encoder_replay, prefix_cache): a multi-turn mode, the context's
                last `turn` tokens being a new turn on a cached prefix (docs/semantics.md 4.3),
                mode (instead of the above: an evals.modes string, ';' for ','),
                topk (int | all: override the checkpoint's top-k), dtype (float32 | float64),
                batch_size, max_gen_toks (default 256), bos (true | false, default true: false
                for contexts that start mid-document); the device comes from lm_eval's
                --device (cuda:0 by default there: falls back to cpu when CUDA is absent)

Every request runs through `evals.modes.mode_logits` / `InferenceEngine`: prefill of the context
with the configured replay (or prefix cache + `extend` for a turn mode), then the continuation
teacher-forced through decode steps; never one full forward. Tokens are `ced.data.ByteTokenizer`
bytes, and every context gets BOS prepended ([BOS] + context bytes, as in `ced.data`) unless
bos=false (an empty context always gets one).

  loglikelihood          sum of log p(continuation bytes) and whether every byte is the argmax
                         (lm-eval's `acc` on a loglikelihood task is then teacher-forced exact
                         match, the suite runner's score)
  loglikelihood_rolling  lm-eval's rolling windows of max_seq_len over [BOS] + text; each window
                         prefilled with the replay (a turn mode's turn/policy are not applied:
                         the first window's context is BOS alone)
  generate_until         greedy under the mode (`evals.modes.mode_generate`: one prefill or
                         turn, then decode steps); cut at EOS, at an `until` string, or
                         after max_gen_toks

Contexts longer than max_seq_len (minus the continuation / max_gen_toks) keep BOS and their
last tokens.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict

import lm_eval.models  # noqa: F401  (registers the built-in models before ours: see get_model)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ced.config import state_replay
from ced.data import ByteTokenizer
from evals.modes import Mode, mode_generate, mode_logits, named_mode, parse_mode, resolve_mode

log = logging.getLogger(__name__)
_TOK = ByteTokenizer()


# Every key `--model_args` may hold, and the ones lm-eval adds itself (from --device,
# --batch_size, --max_batch_size). Anything else is a typo and an error: ignoring it would
# score another mode than the one asked for, with exit status 0.
MODEL_ARGS = ("checkpoint", "replay", "turn", "policy", "encoder_replay", "prefix_cache", "mode",
              "topk", "dtype", "device", "batch_size", "max_batch_size", "max_gen_toks", "bos")


class ModelArgsError(ValueError):
    """A bad `--model_args` value or checkpoint; one line naming the key or the path."""


def build_mode(replay=None, turn=None, policy=None, encoder_replay=None, prefix_cache=None,
               mode=None) -> str:
    """The evals.modes string for lm-eval model_args."""
    if mode is not None:
        if any(v is not None for v in (replay, turn, policy, encoder_replay, prefix_cache)):
            raise ModelArgsError("model_args: give either mode=... or replay/turn/policy, not "
                                 "both")
        return str(mode).replace(";", ",")

    def none(v) -> bool:
        return v is None or str(v).lower() in ("", "none", "null", "full")

    replay_part = None if none(replay) else f"replay={replay}"
    if none(turn):
        if not (none(policy) and none(encoder_replay) and prefix_cache is None):
            raise ModelArgsError("model_args: policy/encoder_replay/prefix_cache need "
                                 "turn=<tokens>")
        return replay_part or "full"
    parts = [f"turn={turn}", f"policy={policy or 'keep_decoder_swa'}"]
    if replay_part:
        parts.append(replay_part)
    if not none(encoder_replay):
        parts.append(f"encoder_replay={encoder_replay}")
    if prefix_cache is not None:
        flag = str(prefix_cache).lower()   # anything but these four: parse_mode's error
        parts.append(f"prefix_cache={ {'true': '1', 'false': '0'}.get(flag, flag)}")
    return ",".join(parts)


def _positive_int(value, key: str) -> int:
    """A model_args value that must be an int >= 1, or a ModelArgsError naming `key`."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ModelArgsError(f"ced: model_args {key} must be an int >= 1; got {value!r}")
    return number


def _say_replay(cfg, written) -> str:
    """Print the replay form as written beside the N it resolves to for `cfg` (and a warning
    naming R_exact where it is capped); returns that statement."""
    stated = state_replay(cfg, written, name="replay")
    print(f"ced: replay {stated}", file=sys.stderr, flush=True)
    if stated.warning():
        print(f"ced: {stated.warning()}", file=sys.stderr, flush=True)
    return str(stated)


@register_model("ced")
class CEDLM(LM):
    def __init__(self, checkpoint: str | None = None, replay=None, turn=None, policy=None,
                 encoder_replay=None, prefix_cache=None, mode: str | None = None, topk=None,
                 dtype: str = "float32", device: str | None = "cpu", batch_size=16,
                 max_batch_size=None, max_gen_toks: int = 256, bos=True, model=None,
                 **unused) -> None:
        super().__init__()
        # lazy: evals.suites.runner costs ~0.1 s to import; registering --model ced (also for
        # lm-eval's --help) builds no model
        from evals.suites.runner import load_checkpoint, make_engine

        if unused:
            raise ModelArgsError(f"ced: unknown model_args key(s) {sorted(unused)}; allowed: "
                                 f"{list(MODEL_ARGS)}")
        max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        # false: contexts that start mid-document (the code tasks) get no BOS, as training
        # rows that start mid-file had none; an empty context still gets one
        self.bos = _flag(bos, "bos")
        try:
            self.mode_name = build_mode(replay, turn, policy, encoder_replay, prefix_cache, mode)
            # user input at lm-eval's command line (model_args): the one mode text read here
            self.mode: Mode = parse_mode(self.mode_name)
        except ValueError as exc:
            raise ModelArgsError(f"ced: model_args: {exc}") from None
        device = str(device or "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's CLI passes --device cuda:0 unless told otherwise
            log.warning("ced: device %s is not available; using cpu", device)
            device = "cpu"
        if model is None:
            if checkpoint is None:
                raise ModelArgsError("ced: model_args needs checkpoint=<directory of "
                                     "save_model>")
            try:
                model = load_checkpoint(checkpoint, topk=topk, dtype=dtype, device=device)
            except ValueError as exc:   # CheckpointError included: names the file
                raise ModelArgsError(f"ced: {str(exc).splitlines()[0]}") from None
        self.model = model.eval()
        self.cfg = model.cfg
        if self.mode.replay is not None and not self.cfg.has_decoder:
            raise ModelArgsError(f"ced: replay needs a decoder; variant {self.cfg.variant!r} "
                                 f"has none")
        written = self.mode.replay
        try:    # replay=W and the other window forms: this checkpoint's own length
            self.mode = resolve_mode(self.mode, self.cfg)
        except ValueError as exc:
            raise ModelArgsError(f"ced: model_args: {exc}") from None
        self.mode_name = self.mode.name
        # the form as written beside the N that runs (lm-eval's own table shows only the
        # model_args string)
        self.replay_said = _say_replay(self.cfg, written) \
            if written is not None and self.mode.turn is None else None
        # rolling windows start from a lone BOS: no turn to split off
        self.rolling_mode = named_mode(replay=self.mode.replay)
        replays = [int(self.mode.replay)] if isinstance(self.mode.replay, int) else []
        self.engine = make_engine(model, replays)
        self.batch_size = _batch_size(batch_size)
        self.max_gen_toks = max_gen_toks
        self.checkpoint = checkpoint
        self._device = next(model.parameters()).device

    # ---- lm-eval plumbing --------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        return self.cfg.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return "ced-byte"

    @property
    def eot_token_id(self) -> int:
        return _TOK.eos

    def get_model_info(self) -> dict:
        return {"ced_checkpoint": str(self.checkpoint), "ced_mode": self.mode_name,
                "ced_replay": self.replay_said, "ced_variant": self.cfg.variant,
                "ced_topk": self.cfg.topk}

    # ---- scoring -----------------------------------------------------------------------------
    def _start(self, context: str) -> list[int]:
        """The context's token ids: BOS first (model_args bos, default true; always for an
        empty context, which has nothing else to prefill)."""
        ids = _TOK.encode(context)
        return [_TOK.bos] + ids if self.bos or not ids else ids

    def _truncate(self, ctx: list[int], room: int) -> list[int]:
        """Keep BOS and the last tokens so that len(ctx) <= room."""
        if room < 1:
            raise ValueError(f"ced: the continuation does not fit in max_seq_len="
                             f"{self.cfg.max_seq_len}")
        if len(ctx) <= room:
            return ctx
        if ctx and ctx[0] == _TOK.bos and room > 1:
            return [_TOK.bos] + ctx[len(ctx) - room + 1:]
        return ctx[len(ctx) - room:]

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]], mode: Mode | None = None
              ) -> list[tuple[float, bool]]:
        """(log p(continuation | context), all-greedy) for token-id pairs, batched by equal
        lengths, through `mode_logits` (the engine path)."""
        mode = mode or self.mode
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        prepared = []
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                out[i] = (0.0, True)
                prepared.append(None)
                continue
            ctx = self._truncate(list(ctx), self.cfg.max_seq_len - len(cont) + 1)
            prepared.append((ctx, list(cont)))
            groups[(len(ctx), len(cont))].append(i)
        for key in sorted(groups):
            idx = groups[key]
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s:s + self.batch_size]
                ctx = torch.tensor([prepared[i][0] for i in chunk], device=self._device)
                cont = torch.tensor([prepared[i][1] for i in chunk], device=self._device)
                logits = mode_logits(self.engine, ctx, cont, mode).double()
                logp = torch.log_softmax(logits, -1).gather(-1, cont[..., None])[..., 0]
                greedy = logits.argmax(-1).eq(cont).all(-1)
                for j, i in enumerate(chunk):
                    out[i] = (float(logp[j].sum()), bool(greedy[j]))
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [(self._start(ctx), _TOK.encode(cont))
                 for ctx, cont in (r.args for r in requests)]
        results = self.score(pairs)
        for r, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", r.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for k, r in enumerate(requests):
            (text,) = r.args
            for window in get_rolling_token_windows(token_list=_TOK.encode(text),
                                                    prefix_token=_TOK.bos,
                                                    max_seq_len=self.cfg.max_seq_len,
                                                    context_len=1):
                pairs.append(make_disjoint_window(window))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, self.score(pairs, self.rolling_mode)):
            totals[k] += ll
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        prepared = []
        for i, r in enumerate(requests):
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0) or 0) > 0:
                log.warning("ced: sampling requested; generating greedily")
            ctx = self._truncate(self._start(context),
                                 self.cfg.max_seq_len - max_new + 1)
            prepared.append((ctx, until, max_new))
            groups[(len(ctx), max_new)].append(i)
        for (_, max_new), idx in sorted(groups.items()):
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s:s + self.batch_size]
                ctx = torch.tensor([prepared[i][0] for i in chunk], device=self._device)
                untils = [prepared[i][1] for i in chunk]
                tokens = self._greedy(ctx, max_new, untils)
                for j, i in enumerate(chunk):
                    out[i] = _cut(tokens[j], untils[j])
        for r, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", r.args, text)
        return out  # type: ignore[return-value]

    def _greedy(self, ctx: torch.Tensor, max_new: int, untils: list[list[str]]) -> list[list[int]]:
        """Greedy tokens under the configured mode; EOS and stop strings are cut by `_cut`."""
        return mode_generate(self.engine, ctx, max_new, self.mode).tolist()


def _flag(value, key: str) -> bool:
    """A boolean model_arg: true/false/1/0 (any case), else a one-line error naming `key`."""
    flag = str(value).lower()
    if flag not in ("true", "false", "1", "0"):
        raise ModelArgsError(f"ced: model_args {key} must be true or false; got {value!r}")
    return flag in ("true", "1")


def _cut(tokens: list[int], until: list[str]) -> str:
    """Text before EOS and before the first `until` string."""
    if _TOK.eos in tokens:
        tokens = tokens[:tokens.index(_TOK.eos)]
    text = _TOK.decode(tokens)
    for u in until:
        if u and u in text:
            text = text[:text.index(u)]
    return text


def _batch_size(value) -> int:
    try:
        size = int(str(value).split(":")[0]) if str(value).split(":")[0] != "auto" else 16
    except ValueError:
        size = 16
    return max(1, size)
