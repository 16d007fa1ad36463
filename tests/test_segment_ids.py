"""zeco_jax.segments, the packed-document helpers every op and layer uses: FLA's
``cu_seqlens`` to ``segment_ids`` (padding after the last document, errors for bad
offsets), document starts and the position of each token in its document."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeco_jax import segments


def test_cu_seqlens_to_segment_ids():
  ids = segments.cu_seqlens_to_segment_ids(np.array([0, 3, 3, 7]), 10)
  np.testing.assert_array_equal(ids, [[0, 0, 0, 2, 2, 2, 2, -1, -1, -1]])
  full = jax.jit(segments.cu_seqlens_to_segment_ids, static_argnums=1)(jnp.array([0, 4, 6]), 6)
  np.testing.assert_array_equal(full, [[0, 0, 0, 0, 1, 1]])
  starts = segments.document_starts(jnp.asarray([[5, 5, -1, 5, 6, 6]]))
  np.testing.assert_array_equal(starts, [[1, 0, 0, 1, 1, 0]])
  pos = segments.position_in_document(jnp.asarray([[5, 5, -1, 5, 6, 6]]))
  np.testing.assert_array_equal(pos, [[0, 1, 0, 0, 0, 1]])
  for bad in (np.array([1, 3]), np.array([0, 5, 4]), np.array([0, 11])):
    with pytest.raises(ValueError, match="cu_seqlens"):
      segments.cu_seqlens_to_segment_ids(bad, 10)


def test_document_spans_are_runs_of_non_negative_ids():
  assert segments.document_spans([0, 0, 1, -1, -1, 1, 1, 2]) == [(0, 2), (2, 3), (5, 7),
                                                                   (7, 8)]
  assert segments.document_spans([-1, -1]) == []
