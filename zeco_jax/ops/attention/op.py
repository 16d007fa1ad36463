"""Softmax attention on one device, by backend: XLA, cuDNN or splash.

Where a head's whole sequence is on one device (the one-device op; Ulysses after its
all-to-all), attention runs through one of :data:`BACKENDS`:

========= ======== ===========================================================================
backend   platform what runs, and what it takes
========= ======== ===========================================================================
"xla"     any      :func:`zeco_jax.ops.attention.blockwise.attend`: query blocks, each a scan
                   over key blocks with an online softmax, invisible pairs skipped, each
                   block rematerialised
"cudnn"   GPU      ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's fused
                   flash attention: q, k, v of one dtype, bf16 or f16, D a multiple of 8 up
                   to 128; a window only with ``causal``; no ``segment_ids`` (the public API
                   takes no packed documents)
"splash"  TPU      Pallas splash attention (``jax.experimental.pallas.ops.tpu``; the Pallas
                   interpreter on CPU, for tests): the MQA kernel under ``vmap`` over batch
                   and key heads, documents as its segment ids; T a multiple of 128,
                   blocks of 512 (1024 for long T: its block tables sit in SMEM, so at
                   most 256K tokens of whole sequence per device)
========= ======== ===========================================================================

``"auto"`` picks splash on TPU and cuDNN on GPU where they take the inputs, else XLA, and
says once per process (a warning) why it ran XLA on an accelerator. An explicit kernel
backend that cannot take the inputs raises a ValueError that says why.

All backends share the masks of :mod:`zeco_jax.ops.attention.reference`: documents are
numbered runs (``document_numbers``), so a splash segment id never joins two runs with
equal ids; padding queries (document -1) output zero.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp

from zeco_jax import _checks
from zeco_jax.ops.attention.blockwise import attend, finish, group_queries
from zeco_jax.ops.attention.reference import document_numbers
from zeco_jax.runtime import target


@dataclasses.dataclass(frozen=True)
class AttentionArgs:
  B: int
  T: int
  H: int
  Hkv: int
  D: int
  scale: float
  causal: bool
  window: Optional[int]


def check_inputs(q, k, v, segment_ids, scale, causal, window, *, name: str) -> AttentionArgs:
  """Raises ValueError naming the argument; returns the sizes and the resolved scale."""
  for arg, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4 or not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name}: `{arg}` must be floating [B, T, heads, D], got "
                       f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', ())}.")
  B, T, H, D = q.shape
  if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != D:
    raise ValueError(f"{name}: `k` and `v` must be [B, T, Hkv, D] = [{B}, {T}, Hkv, {D}] "
                     f"alike, got k {k.shape} and v {v.shape}.")
  Hkv = k.shape[2]
  if Hkv == 0 or H % Hkv:
    raise ValueError(f"{name}: the key heads Hkv = {Hkv} must divide the query heads H = {H} "
                     "(grouped-query attention).")
  if segment_ids is not None:
    ids = segment_ids
    if getattr(ids, "shape", None) != (B, T) or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"{name}: `segment_ids` must be integer [B, T] = [{B}, {T}], got "
                       f"{getattr(ids, 'dtype', type(ids))} {getattr(ids, 'shape', ())}.")
  if window is not None and (not isinstance(window, int) or window < 1):
    raise ValueError(f"{name}: `window` must be None or a positive int (tokens a query "
                     f"sees, itself included), got {window!r}.")
  if not isinstance(causal, bool):
    raise ValueError(f"{name}: `causal` must be a bool, got {causal!r}.")
  scale = D ** -0.5 if scale is None else float(scale)
  return AttentionArgs(B, T, H, Hkv, D, scale, causal, window)


BACKENDS = ("auto", "xla", "cudnn", "splash")
SPLASH_BLOCKS = (512, 256, 128)      # splash's q / kv tile: the largest that divides T ...
SPLASH_MAX_BLOCK = 1024              # ... doubled up to this while its block tables are big
                                     # (2048 needed 26.9 MiB of scoped VMEM on v5p, over 16):
SPLASH_MAX_TABLE = 1 << 16           # (T / block)^2 entries per table, which sit in the
                                     # TPU's 1 MiB of SMEM (1024^2 int16 entries did not fit)
SPLASH_COMPUTE = 512                 # keys per inner step of a block (the f32 score tile)


def splash_block(T: int):
  """splash's q / kv block for a local sequence of T tokens, or None (T too long)."""
  b = next((s for s in SPLASH_BLOCKS if T % s == 0), None)
  if b is None:
    return None
  while (T // b) ** 2 > SPLASH_MAX_TABLE and b < SPLASH_MAX_BLOCK and T % (2 * b) == 0:
    b *= 2
  return b if (T // b) ** 2 <= SPLASH_MAX_TABLE else None


def why_not(backend: str, platform: str, *, dtypes, D: int, T: int, causal: bool,
            window: Optional[int], segmented: bool) -> Optional[str]:
  """Why ``backend`` ("cudnn" or "splash") cannot run these inputs; None when it can."""
  if backend == "cudnn":
    if platform != "gpu":
      return f"cuDNN runs on GPU, the target is {platform}"
    if len(set(dtypes)) != 1 or dtypes[0] not in (jnp.bfloat16, jnp.float16):
      return f"cuDNN takes q, k, v of one dtype, bf16 or f16, got {', '.join(map(str, dtypes))}"
    if D % 8 or D > 128:
      return f"cuDNN takes a head size D that is a multiple of 8 up to 128, got {D}"
    if segmented:
      return "cuDNN's public API takes no documents (segment_ids)"
    if window is not None and not causal:
      return "cuDNN takes a window only with causal=True"
    return None
  if backend == "splash":
    if platform not in ("tpu", "cpu"):
      return f"splash attention runs on TPU (interpreted on CPU), the target is {platform}"
    if T % SPLASH_BLOCKS[-1]:
      return f"splash attention tiles T by 128: T = {T} is not a multiple of 128"
    if splash_block(T) is None:
      return (f"splash attention's block tables for T = {T} would not fit the TPU's SMEM "
              f"(at most {SPLASH_MAX_BLOCK * 256} tokens of whole sequence per device, in "
              f"blocks of up to {SPLASH_MAX_BLOCK})")
    return None
  raise AssertionError(backend)


@functools.lru_cache(maxsize=None)
def _say_xla(platform: str, reason: str) -> None:
  warnings.warn(f"zeco_jax: attention backend='auto' on {platform} runs the XLA form: "
                f"{reason}. Pass backend='xla' to choose it explicitly (and silence this).",
                stacklevel=4)


def resolve(backend: str, platform: str, *, dtypes, D: int, T: int, causal: bool,
            window: Optional[int], segmented: bool, name: str) -> str:
  """``"xla"``, ``"cudnn"`` or ``"splash"`` for ``backend`` on the target ``platform``."""
  _checks.check_choice(backend, BACKENDS, arg="backend", name=name)
  facts = dict(dtypes=tuple(jnp.dtype(d) for d in dtypes), D=D, T=T, causal=causal,
               window=window, segmented=segmented)
  if backend == "xla" or (backend == "auto" and platform == "cpu"):
    return "xla"
  if backend == "auto":
    kernel = "splash" if platform == "tpu" else "cudnn"
    reason = why_not(kernel, platform, **facts)
    if reason:
      _say_xla(platform, reason)
      return "xla"
    return kernel
  reason = why_not(backend, platform, **facts)
  if reason:
    raise ValueError(f"{name}: backend={backend!r} cannot run these inputs: {reason}; use "
                     "backend='xla' (or 'auto').")
  return backend


def local_attention(q, k, v, doc, *, backend: str, platform: str, scale: float, causal: bool,
                    window: Optional[int], block_size: int):
  """Attention of the whole local sequence: q ``[B, T, H, D]``, k, v ``[B, T, Hkv, D]``,
  ``doc`` int32 ``[B, T]`` document numbers (-1 padding) or None (one document).
  ``backend``: a resolved one (:func:`resolve`). Returns ``[B, T, H, D]`` in v's dtype."""
  B, T = q.shape[:2]
  if backend == "cudnn":
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0))
  if backend == "splash":
    o = _splash(q, k, v, doc, scale=scale, causal=causal, window=window,
                interpret=platform == "cpu")
    return o if doc is None else jnp.where((doc >= 0)[:, :, None, None], o, 0).astype(o.dtype)
  if backend != "xla":
    raise AssertionError(backend)
  d = jnp.zeros((B, T), jnp.int32) if doc is None else doc
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  stats = attend(group_queries(q, k.shape[2]), k, v, d, pos, d, pos, scale=scale,
                 causal=causal, window=window, block_size=block_size)
  return finish(stats, v.dtype)


def _splash(q, k, v, doc, *, scale, causal, window, interpret):
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as sk, splash_attention_mask as sm)
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  G = H // Hkv
  shape = (T, T)
  if window is None:
    mask = sm.CausalMask(shape) if causal else sm.FullMask(shape)
  else:                        # query t sees keys s with t - s < window (and s <= t if causal)
    mask = sm.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=0)
  b = splash_block(T)
  c = min(b, SPLASH_COMPUTE)
  # The fused backward (dq, dk, dv in one kernel) needs only the dkv block tables.
  sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=c, block_q_dkv=b,
                        block_kv_dkv=b, block_kv_dkv_compute=c, use_fused_bwd_kernel=True)
  kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([mask] * G), block_sizes=sizes,
                                            interpret=interpret)
  dtype = jnp.promote_types(q.dtype, v.dtype)
  qh = (q.astype(jnp.float32) * scale).astype(dtype)      # splash does not scale the scores
  qh = qh.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4)          # [B, Hkv, G, T, D]
  kh, vh = (x.astype(dtype).transpose(0, 2, 1, 3) for x in (k, v))   # [B, Hkv, T, D]

  if doc is None:
    one = lambda qq, kk, vv: kernel(qq, kk, vv)
    o = jax.vmap(jax.vmap(one))(qh, kh, vh)
  else:
    one = lambda qq, kk, vv, ii: kernel(qq, kk, vv, segment_ids=sk.SegmentIds(q=ii, kv=ii))
    o = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(qh, kh, vh, doc)
  return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(v.dtype)


def attention(q, k, v, *, causal: bool = True, segment_ids=None, scale=None, window=None,
              backend: str = "auto", block_size: int = 512):
  """Softmax attention on one device (the masks and layouts of
  :mod:`zeco_jax.ops.attention.reference`): ``[B, T, H, D]`` in v's dtype.

  ``backend``: one of :data:`BACKENDS` (the module's table), ``"auto"`` by the platform the
  inputs are compiled for. ``block_size``: keys per block of the XLA form's online softmax
  (the whole T when it does not divide T)."""
  name = "attention"
  a = check_inputs(q, k, v, segment_ids, scale, causal, window, name=name)
  platform = target.platform_of(q, k, v)
  backend = resolve(backend, platform, dtypes=(q.dtype, k.dtype, v.dtype), D=a.D, T=a.T,
                    causal=causal, window=window, segmented=segment_ids is not None, name=name)
  doc = None if segment_ids is None else document_numbers(segment_ids, a.B, a.T)
  return local_attention(q, k, v, doc, backend=backend, platform=platform, scale=a.scale,
                         causal=causal, window=window, block_size=block_size)


__all__ = ["AttentionArgs", "BACKENDS", "attention", "check_inputs", "local_attention",
           "resolve", "why_not"]
