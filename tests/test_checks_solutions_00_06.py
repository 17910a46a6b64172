"""The lesson 00 and 06 checkers accept the reference answers and reject realistic wrong ones."""
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


def test_lesson06_counting_references_pass_and_off_by_one_answers_fail():
    from solutions import lesson06

    assert checks.check_tree_rounds(lesson06.rounds)
    assert not checks.check_tree_rounds(lambda p: p.bit_length())            # 1 too many at 2^k
    assert checks.check_elements_sent(lesson06.elements_sent)
    assert not checks.check_elements_sent(lambda n, p, rank=0: 2 * (p - 1) * (n // p))  # floor
