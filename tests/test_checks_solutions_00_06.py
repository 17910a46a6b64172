"""The lesson 00 and 01 checkers accept the reference answers and reject realistic wrong ones."""
from course_lib import checks
from solutions import lesson00


def test_matmul_flops_checker_accepts_reference_and_rejects_square_only_answers():
    assert checks.check_matmul_flops(lesson00.matmul_flops)
    assert not checks.check_matmul_flops(lambda n, k, m: 2 * n**3)     # right for squares only
    assert not checks.check_matmul_flops(lambda n, k, m: n * k * m)    # forgot the adds
    assert not checks.check_matmul_flops(lambda n, k, m: 2 * n * m)    # forgot the length k
    assert checks.check_matmul_flops(None).ok is None                  # open, not failed


def test_try_all_gpus_checker_accepts_reference():
    assert checks.check_try_all_gpus(lesson00.try_all_gpus)
    assert not checks.check_try_all_gpus(lambda: [])                   # d2l 1.0.3 on a CPU
