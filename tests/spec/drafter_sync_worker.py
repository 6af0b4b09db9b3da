"""2 ranks (gloo): each trains its own drafter on its own rollouts (other data, another number of
steps), then ``average_drafter`` over the rollout data-parallel group: the weights must be
bitwise identical on both ranks and equal to the mean of what they held."""
import torch
import torch.distributed as dist

from megarl.spec.drafter_train import average_drafter
from tests.spec.test_drafter import _drafter_engine, _requests, _target


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    eng = _drafter_engine(_target(), max_batch_size=8, seed=rank)  # another init per rank
    eng.generate(_requests(range(8 * rank, 8 * rank + 8)), step=rank)
    src = eng.spec.drafter
    src.trainer.train(max_steps=2 + 3 * rank)
    mine = torch.cat([p.detach().reshape(-1) for p in src.model.parameters()])
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    assert not torch.equal(both[0], both[1])
    average_drafter(src.model, group)
    after = torch.cat([p.detach().reshape(-1) for p in src.model.parameters()])
    every = [torch.empty_like(after) for _ in range(2)]
    dist.all_gather(every, after)
    assert torch.equal(every[0], every[1]), "drafter weights differ between replicas"
    assert torch.allclose(after, (both[0] + both[1]) / 2, atol=1e-12)
    # the drafts of the averaged drafters are the same on both ranks
    eng.reset_stats()
    out = eng.generate(_requests(range(40, 44)), step=7)
    drafted = torch.tensor([eng.spec.metrics()["spec/drafter/accepted"]])
    got = [torch.empty_like(drafted) for _ in range(2)]
    dist.all_gather(got, drafted)
    assert got[0].item() == got[1].item() and len(out) == 16
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
