"""The other half of the JAX child suite (see test_jax_backend.py): the
files of test_jax_backend.HALF, under Keras's JAX backend in a child
pytest."""

from tests.jax_backend._jax_suite import HALF, run_jax_suite


def test_the_longest_jax_backend_files_pass_under_the_jax_backend(tmp_path):
    output = run_jax_suite(tmp_path, files=HALF)
    # Each file ran: pytest -q prints one progress line per file at most
    # when its tests fit, so count the collected tests instead.
    assert int(output.rsplit(" passed", 1)[0].split()[-1]) >= 3 * len(HALF), output[-2000:]
