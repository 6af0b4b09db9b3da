"""Worker of test_vllm_groups.py, on 2 gloo processes (asserts itself; a failure exits non-zero):
:func:`megarl.engine.vllm_groups.check_group_count` passes while both processes have made the same
process groups, and once one has made a group the other has not, fails on both with the counts."""
import torch.distributed as dist

from megarl.engine.vllm_groups import check_group_count


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.new_group([0, 1])
    check_group_count()  # the same groups so far: passes
    if rank == 1:
        dist.new_group([1])  # a group of rank 1 alone, made on rank 1 only: the counts now differ
    try:
        check_group_count()
    except RuntimeError as e:
        assert "different numbers of process groups so far ([2, 3], by rank)" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: different group counts were not caught")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
