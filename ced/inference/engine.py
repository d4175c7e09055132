"""Incremental inference: prefill (full, or early exit with bounded/exact replay), decode,
greedy generation, and multi-turn extension with the prefix-cache policies of
docs/semantics.md section 4.3.

The engine holds no model math: it orders calls to `CEDModel.run_layers` over its cache.
Every call is all-or-nothing on the cache it is given: arguments are checked before anything
changes, and a call that fails anyway (an error inside the model, an interrupt) restores the
cache to what it was, so a later call never reads a half-updated cache.
Inside the engine a replay start acts by absence: positions the decoder never computed are not
in its window caches, so no query can see them. The parallel forward expresses the same thing
with `decoder_replay_start`; tests hold the two equal.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch
from torch import Tensor

from ..config import default_hidden_tail, exact_policy_encoder_replay_length, resolve_replay
from ..model import CEDModel, ForwardContext, ModelState, WindowKV

# None, an int N >= 1, or a symbolic length ('exact', 'R_exact', 'W', 'W/4', '2W', ...):
# every form `ced.config.replay_length` resolves.
Replay = None | int | str
POLICIES = ("keep_decoder_swa", "suffix_only", "cached_hidden", "encoder_replay")


@dataclass
class Cache:
    """What the engine keeps for a batch of sequences of equal length.

    state: window KV per layer and global KV per source (see `ModelState`);
    tokens: LongTensor[B, length], every token consumed so far (an encoder replay needs them);
    encoder_hidden: H_{L_e} [B, n, D] of the last n positions, kept for the `cached_hidden`
    policy; decoder_layers: indices of the decoder layers (their windows are the decoder's);
    encoder_windows_evicted / decoder_windows_evicted: set by `as_prefix_cache`.
    """

    state: ModelState
    tokens: Tensor
    encoder_hidden: Tensor | None
    decoder_layers: frozenset[int]
    encoder_windows_evicted: bool = False
    decoder_windows_evicted: bool = False

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def as_prefix_cache(self, keep_decoder_windows: bool = False) -> "Cache":
        """A copy as V4.1's prefix cache keeps it (docs/semantics.md 4.2): global KV only.
        Window KV is evicted (the decoder's kept if asked, for the `keep_decoder_swa` policy),
        and so is the pending state of an incomplete compression block; the H_{L_e} tail stays,
        for the `cached_hidden` policy (`nbytes` reports its memory)."""
        windows = [None if w is None else replace(w)
                   if keep_decoder_windows and i in self.decoder_layers else _empty_window(w)
                   for i, w in enumerate(self.state.windows)]
        sources = [replace(s, pending_tokens=s.pending_tokens[:, :0],
                           pending_gates=s.pending_gates[:, :0]) for s in self.state.sources]
        return Cache(ModelState(windows, sources), self.tokens, self.encoder_hidden,
                     self.decoder_layers, encoder_windows_evicted=True,
                     decoder_windows_evicted=not keep_decoder_windows)

    def clear_decoder_windows(self) -> None:
        """Forget decoder window KV: the next decoder positions start a replay segment."""
        for i in self.decoder_layers:
            if self.state.windows[i] is not None:
                self.state.windows[i] = _empty_window(self.state.windows[i])

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: window KV, global KV entries, indexer keys, pending block
        tokens, the H_{L_e} tail, and their total."""
        def size(t: Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()
        counts = {
            "window_kv": sum(size(w.k) + size(w.v) for w in self.state.windows if w is not None),
            "global_kv": sum(size(s.k) + size(s.v) for s in self.state.sources),
            "indexer_keys": sum(size(s.index_keys) for s in self.state.sources),
            "pending_blocks": sum(size(s.pending_tokens) + size(s.pending_gates)
                                  for s in self.state.sources),
            "encoder_hidden": size(self.encoder_hidden),
        }
        counts["total"] = sum(counts.values())
        return counts


@contextmanager
def _all_or_nothing(cache: Cache) -> Iterator[None]:
    """Restore `cache` if the body raises (anything, KeyboardInterrupt included).

    The model and the engine update a cache by rebinding tensors (`state.k = torch.cat(...)`,
    `windows[i] = ...`), never by writing into them: `as_prefix_cache` shares tensors with the
    cache it copies, and so does this snapshot. Keeping the bindings is therefore enough, and
    costs no copy of the cached tensors."""
    state = cache.state
    objects = [cache, state, *(w for w in state.windows if w is not None), *state.sources]
    saved = [(obj, dict(vars(obj))) for obj in objects]
    windows, sources = list(state.windows), list(state.sources)
    try:
        yield
    except BaseException:
        for obj, fields_before in saved:
            vars(obj).clear()
            vars(obj).update(fields_before)
        state.windows[:] = windows
        state.sources[:] = sources
        raise


def _empty_window(window: WindowKV) -> WindowKV:
    return WindowKV(window.k[:, :, :0], window.v[:, :, :0], window.positions[:0])


@dataclass
class PrefillOutput:
    logits: Tensor          # [B, V] at the last prompt position
    cache: Cache
    replay: int             # decoder positions run (T when there is no early exit)
    # With record_hidden: each layer's output [B, n, D] over the positions that layer ran
    # (all T for encoder layers, the last `replay` for decoder layers).
    hidden: dict[int, Tensor] | None = None


class InferenceEngine:
    """Drives a `CEDModel` incrementally; every method runs without gradients and mutates the
    cache it is given (use `Cache.as_prefix_cache` for a copy), all or nothing: a call that
    raises leaves the cache as it was.

    hidden_tail: how many trailing positions of H_{L_e} the cache keeps for the
    `cached_hidden` policy (default: the exact replay length, capped at max_seq_len).
    """

    def __init__(self, model: CEDModel, hidden_tail: int | None = None):
        self.model = model
        self.cfg = model.cfg
        if hidden_tail is None:
            hidden_tail = default_hidden_tail(self.cfg)
        if hidden_tail < 0:
            raise ValueError(f"hidden_tail: must be >= 0; got {hidden_tail}")
        self.hidden_tail = hidden_tail
        self.decoder_layers = frozenset(s.index for s in model.plan.part("decoder"))

    # ---- argument checks -----------------------------------------------------------------

    def _check_ready(self) -> None:
        if self.model.training and self.cfg.dropout > 0:
            raise ValueError("InferenceEngine: the model is in training mode with dropout > 0; "
                             "call model.eval() first")

    def _check_ids(self, ids: Tensor, name: str, length_before: int = 0,
                   batch: int | None = None) -> None:
        """Shape [B, T] with T >= 1, an integer dtype, B == batch (a cache's), every id in
        [0, vocab_size), and the length within max_seq_len; a ValueError naming `name` else."""
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
            shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"{name}: expected a LongTensor [B, T] with T >= 1; got {shape}")
        # A float or bool tensor would either fail deep inside the embedding or, worse, be
        # cast silently (True -> token 1).
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"{name}: token ids must have an integer dtype (torch.long); got "
                             f"{ids.dtype}")
        if batch is not None and ids.shape[0] != batch:
            raise ValueError(f"{name}: batch size {ids.shape[0]} does not match the cache's "
                             f"{batch}")
        low, high = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
        if low < 0 or high >= self.cfg.vocab_size:
            raise ValueError(f"{name}: token ids must lie in [0, {self.cfg.vocab_size}); got "
                             f"values from {low} to {high}")
        if length_before + ids.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"{name}: the sequence would reach {length_before + ids.shape[1]} "
                             f"tokens, over ModelConfig.max_seq_len={self.cfg.max_seq_len}")

    def resolve_replay(self, replay: Replay, available: int, name: str = "replay") -> int:
        """Decoder positions to replay out of `available` (see `ced.config.resolve_replay`)."""
        return resolve_replay(self.cfg, replay, available, name)

    # ---- the one step every public method is made of -------------------------------------

    @torch.no_grad()
    def _advance(self, cache: Cache, new_ids: Tensor, encoder_from: int, decoder_from: int,
                 stored_hidden: Tensor | None = None,
                 record_hidden: dict[int, Tensor] | None = None) -> Tensor:
        """Append new_ids [B, m] to the sequence: the encoder runs positions
        [encoder_from, L + m) (cached tokens before L are an encoder replay), the decoder runs
        [decoder_from, L + m). stored_hidden [B, n, D], if given, is H_{L_e} of the decoder's
        first n positions and takes the place of the encoder's output there.
        Returns logits [B, V] at the last position."""
        model = self.model
        tokens = torch.cat((cache.tokens, new_ids.to(cache.tokens.device, torch.long)), dim=1)
        end = tokens.shape[1]
        ctx = ForwardContext(keep_windows=True, hidden=record_hidden)
        positions = torch.arange(encoder_from, end, device=tokens.device)
        h = model.run_layers("encoder", model.embed_tokens(tokens, encoder_from), positions,
                             cache.state, ctx)
        if self.cfg.has_decoder:
            model.feed_decoder_source(h, positions, cache.state)
            self._keep_hidden(cache, h, encoder_from)
            n_stored = 0 if stored_hidden is None else stored_hidden.shape[1]
            if decoder_from + n_stored < encoder_from:
                raise ValueError("internal: the decoder segment starts before any H_(L_e)")
            decoder_in = h[:, decoder_from + n_stored - encoder_from:]
            if n_stored:
                decoder_in = torch.cat((stored_hidden, decoder_in), dim=1)
            h = model.run_layers("decoder", decoder_in,
                                 torch.arange(decoder_from, end, device=tokens.device),
                                 cache.state, ctx)
        cache.tokens = tokens
        return model.logits(h[:, -1])

    def _keep_hidden(self, cache: Cache, encoder_out: Tensor, first: int) -> None:
        """Keep H_{L_e} of the trailing `hidden_tail` positions; encoder_out covers positions
        [first, L + m). Where the stored tail already has a position, it wins: it came from a
        full encoder pass, the new value may come from a bounded encoder replay."""
        if not self.hidden_tail:
            return
        old = cache.encoder_hidden
        if old is not None and old.shape[1]:
            old_first = cache.length - old.shape[1]
            encoder_out = torch.cat((encoder_out[:, :max(0, old_first - first)], old,
                                     encoder_out[:, cache.length - first:]), dim=1)
        cache.encoder_hidden = encoder_out[:, -self.hidden_tail:]

    # ---- public API --------------------------------------------------------------------------

    def new_cache(self, batch: int) -> Cache:
        tokens = torch.zeros(batch, 0, dtype=torch.long, device=self.model.embed.weight.device)
        return Cache(self.model.empty_state(batch, keep_windows=True), tokens, None,
                     self.decoder_layers)

    def prefill(self, input_ids: Tensor, replay: Replay = None,
                record_hidden: bool = False) -> PrefillOutput:
        """Prefill a batch of prompts [B, T].

        replay=None: every token through every layer (the oracle); an int N: early exit, the
        encoder runs all T tokens and the decoder only the last N (windows truncated at T - N);
        'exact': N = R_exact; any other form of `ced.config.replay_length` ('W', 'W/4', ...)
        likewise. Returns logits [B, V] at position T - 1 and the cache (and, with
        record_hidden, every layer's output hidden states).
        """
        self._check_ready()
        self._check_ids(input_ids, "input_ids")
        n_prompt = input_ids.shape[1]
        n_replay = self.resolve_replay(replay, n_prompt)
        cache = self.new_cache(input_ids.shape[0])
        hidden = {} if record_hidden else None
        logits = self._advance(cache, input_ids, 0, n_prompt - n_replay, record_hidden=hidden)
        return PrefillOutput(logits, cache, n_replay, hidden)

    def decode(self, next_ids: Tensor, cache: Cache) -> Tensor:
        """One token per row, next_ids LongTensor[B], through every layer; returns [B, V]."""
        self._check_ready()
        if cache.length == 0:
            raise ValueError("decode: the cache is empty; call prefill first")
        if cache.encoder_windows_evicted:
            raise ValueError("decode: this is a prefix cache with evicted windows; use extend "
                             "with a policy")
        if not isinstance(next_ids, Tensor) or next_ids.dim() != 1 \
                or next_ids.shape[0] != cache.tokens.shape[0]:
            shape = tuple(next_ids.shape) if isinstance(next_ids, Tensor) else \
                type(next_ids).__name__
            raise ValueError(f"next_ids: expected LongTensor[B] with B={cache.tokens.shape[0]}; "
                             f"got shape {shape}")
        self._check_ids(next_ids[:, None], "next_ids", cache.length, cache.tokens.shape[0])
        with _all_or_nothing(cache):
            return self._advance(cache, next_ids[:, None], cache.length, cache.length)

    def generate(self, input_ids: Tensor, max_new_tokens: int, replay: Replay = None,
                 eos_id: int | None = None) -> Tensor:
        """Greedy generation: prefill (with `replay`), then decode. Returns LongTensor
        [B, max_new_tokens]; after a row emits eos_id it keeps emitting eos_id."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1; got {max_new_tokens}")
        self._check_ids(input_ids, "input_ids", max_new_tokens - 1)
        out = self.prefill(input_ids, replay)
        logits, cache, generated = out.logits, out.cache, []
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            token = logits.argmax(-1)
            if eos_id is not None:
                token = torch.where(done, torch.full_like(token, eos_id), token)
                done |= token == eos_id
            generated.append(token)
            if step + 1 < max_new_tokens:
                logits = self.decode(token, cache)
        return torch.stack(generated, dim=1)

    def extend(self, suffix_ids: Tensor, cache: Cache, policy: str = "keep_decoder_swa",
               replay: Replay = None, encoder_replay: Replay = None) -> Tensor:
        """Append a new turn suffix_ids [B, m] to a conversation; returns logits [B, V].

        replay (N): the decoder runs the last N positions of the whole sequence, truncated at
        their start; None -> every new token with no truncation. When m < N the other N - m
        positions lie in the cached prefix and `policy` says where their H_{L_e} comes from
        (docs/semantics.md 4.3):
          keep_decoder_swa: the previous turn's decoder window KV is still there (a live cache,
            or as_prefix_cache(keep_decoder_windows=True)); the decoder runs only new tokens.
          suffix_only: the decoder replays only the m new tokens, truncated at the prefix end.
          cached_hidden: H_{L_e} of prefix positions comes from the cache's stored tail.
          encoder_replay: H_{L_e} of prefix positions comes from the encoder replay below.
        encoder_replay (N_e): when the cache's encoder windows were evicted (a prefix cache),
        the last N_e prefix tokens rerun the encoder with windows truncated at P - N_e, reusing
        the cached global KV (docs/semantics.md 4.2); 'exact' makes the step exact:
        n_encoder_layers * (window - 1) + 1, and under policy 'encoder_replay', whose decoder
        also reads the encoder replay's outputs at N - m prefix positions,
        n_encoder_layers * (window - 1) + max(N - m, 1) (4.3).
        """
        self._check_ready()
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}; got {policy!r}")
        if cache.length == 0:
            raise ValueError("extend: the cache is empty; call prefill first")
        self._check_ids(suffix_ids, "suffix_ids", cache.length, cache.tokens.shape[0])
        with _all_or_nothing(cache):
            return self._extend(suffix_ids, cache, policy, replay, encoder_replay)

    def _encoder_from(self, cache: Cache, encoder_replay: Replay) -> int:
        """First position the encoder runs when `extend` appends to `cache`: the cache's
        length on a live cache (no encoder replay allowed), else P - N_e (docs/semantics.md
        4.2), which must reach back to the incomplete compression block."""
        prefix = cache.length
        if not cache.encoder_windows_evicted:
            if encoder_replay is not None:
                raise ValueError("encoder_replay: the encoder windows of this cache are intact; "
                                 "encoder replay applies to a prefix cache "
                                 "(Cache.as_prefix_cache)")
            return prefix
        if encoder_replay is None:
            raise ValueError("encoder_replay: the cache's encoder windows were evicted "
                             "(a prefix cache); pass an int N_e >= 1 or 'exact'")
        encoder_from = prefix - resolve_replay(self.cfg, encoder_replay, prefix,
                                               "encoder_replay", part="encoder")
        # The incomplete block's tokens were evicted with the windows; the replay rebuilds them.
        block_starts = [s.next_position for s in cache.state.sources]
        if block_starts and encoder_from > min(block_starts):
            raise ValueError(f"encoder_replay: must reach back to position {min(block_starts)}"
                             f" (the incomplete compression block), i.e. be >= "
                             f"{prefix - min(block_starts)}; got {prefix - encoder_from}")
        return encoder_from

    def _extend(self, suffix_ids: Tensor, cache: Cache, policy: str, replay: Replay,
                encoder_replay: Replay) -> Tensor:
        """`extend` once its arguments are checked; the caller restores the cache on failure."""
        prefix, n_new = cache.length, suffix_ids.shape[1]
        end = prefix + n_new
        if not self.cfg.has_decoder:
            encoder_from = self._encoder_from(cache, encoder_replay)
            if replay is not None:
                self.resolve_replay(replay, end)   # raises: no decoder
            return self._advance(cache, suffix_ids, encoder_from, encoder_from)

        n_replay = self.resolve_replay(replay, end) if replay is not None else n_new
        if (policy == "encoder_replay" and isinstance(encoder_replay, str)
                and encoder_replay.replace(" ", "") in ("exact", "R_exact")):
            # 'exact' promises an exact step: this policy's bound, not the encoder's own (4.3)
            encoder_replay = exact_policy_encoder_replay_length(self.cfg, n_replay, n_new)
        encoder_from = self._encoder_from(cache, encoder_replay)
        replay_start = end - n_replay
        stored_hidden = None
        if policy == "keep_decoder_swa":
            if cache.decoder_windows_evicted:
                raise ValueError("policy 'keep_decoder_swa': this prefix cache dropped the "
                                 "decoder windows; build it with keep_decoder_windows=True")
            decoder_from = max(prefix, replay_start)
        elif policy == "suffix_only":
            decoder_from = max(prefix, replay_start)
        elif policy == "encoder_replay":
            if not cache.encoder_windows_evicted:
                raise ValueError("policy 'encoder_replay': needs a prefix cache with evicted "
                                 "encoder windows (Cache.as_prefix_cache) and encoder_replay")
            decoder_from = max(encoder_from, replay_start)
        else:  # cached_hidden: prefix positions of the segment read the stored H_{L_e}
            decoder_from = replay_start
            if decoder_from < prefix:
                stored = 0 if cache.encoder_hidden is None else cache.encoder_hidden.shape[1]
                if stored < prefix - decoder_from:
                    raise ValueError(f"policy 'cached_hidden': needs H_(L_e) of "
                                     f"{prefix - decoder_from} cached positions, the cache "
                                     f"holds {stored} (raise InferenceEngine's hidden_tail)")
                stored_hidden = cache.encoder_hidden[:, stored - (prefix - decoder_from):]
        # A replay segment starts where the decoder has no window state: truncation by absence.
        if policy != "keep_decoder_swa" or decoder_from > prefix:
            cache.clear_decoder_windows()
        cache.encoder_windows_evicted = False
        cache.decoder_windows_evicted = False
        return self._advance(cache, suffix_ids, encoder_from, decoder_from, stored_hidden)
