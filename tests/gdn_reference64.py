"""Float64 numpy truth for Gated DeltaNet tests: the token loop and its hand-written vjp.

No jax x64 needed: the forward and the reverse pass are written out in numpy float64.
"""
import numpy as np


def gdn_float64(q, k, v, g, beta, h0, do, dht, scale=None):
  """Token loop S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
  o_t = scale S_t^T q_t, in float64; returns (o, final, grads) with grads the vjp of
  (do, dht) for q, k, v, g, beta, h0."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, g, beta, do, dht = map(f, (q, k, v, g, beta, do, dht))
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  S = np.zeros((B, H, K, V)) if h0 is None else f(h0).copy()
  states, o = [S], np.zeros((B, T, H, V))
  for t in range(T):
    a = np.exp(g[:, t])[..., None, None]
    Sd = a * S
    kt = k[:, t]
    u = beta[:, t][..., None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", kt, Sd))
    S = Sd + kt[..., :, None] * u[..., None, :]
    o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
    states.append(S)
  final = S
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
  dS = dht.copy()
  for t in reversed(range(T)):
    S_prev, S_t = states[t], states[t + 1]
    a = np.exp(g[:, t])[..., None, None]
    Sd = a * S_prev
    kt, bt = k[:, t], beta[:, t][..., None]
    dS = dS + scale * q[:, t][..., :, None] * do[:, t][..., None, :]
    dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", S_t, do[:, t])
    r = v[:, t] - np.einsum("bhk,bhkv->bhv", kt, Sd)
    u = bt * r
    dSd = dS.copy()
    dk[:, t] += np.einsum("bhkv,bhv->bhk", dS, u)
    du = np.einsum("bhkv,bhk->bhv", dS, kt)
    dbeta[:, t] = np.sum(du * r, -1)
    dv[:, t] = bt * du
    dw = -bt * du
    dSd += kt[..., :, None] * dw[..., None, :]
    dk[:, t] += np.einsum("bhkv,bhv->bhk", Sd, dw)
    dg[:, t] = np.sum(dSd * Sd, axis=(-2, -1))
    dS = a * dSd
  grads = dict(q=dq, k=dk, v=dv, g=dg, beta=dbeta)
  if h0 is not None:
    grads["h0"] = dS
  return o, final, grads
