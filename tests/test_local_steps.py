from dynabatch.scheduler.local_steps import adacomm_steps


def test_h_starts_at_h0_and_shrinks_with_the_square_root_of_the_loss() -> None:
    assert adacomm_steps(16, 16, 2.0, 2.0, 0.0, 0.1).steps == 16
    assert adacomm_steps(16, 16, 2.0, 0.5, 0.0, 0.1).steps == 8
    assert adacomm_steps(16, 16, 2.0, 0.02, 0.0, 0.1).steps == 2


def test_h_does_not_grow_back_when_the_loss_wobbles() -> None:
    assert adacomm_steps(16, 6, 2.0, 0.6, 0.0, 0.1).steps == 6
    assert adacomm_steps(16, 6, 2.0, 0.4, 0.0, 0.1).steps == 6


def test_h_never_goes_below_what_hides_communication_nor_above_h0() -> None:
    d = adacomm_steps(16, 16, 2.0, 0.02, sync_s=0.35, compute_s=0.1)
    assert d.steps == 4 and "hide communication" in d.reason
    assert adacomm_steps(16, 4, 2.0, 0.02, sync_s=10.0, compute_s=0.1).steps == 16


def test_h_is_at_least_one_and_unchanged_without_a_loss() -> None:
    assert adacomm_steps(16, 16, 2.0, 0.0, 0.0, 0.1).steps == 1
    assert adacomm_steps(16, 9, float("nan"), 1.0, 0.0, 0.1).steps == 9
