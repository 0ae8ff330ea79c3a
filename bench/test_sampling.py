"""End to end: a small torch MLP policy picks the actions of 64 CartPole envs
from their observations, inference in the loop. Every split of the CPUs
between the learner (torch threads, the caller's own env slice) and shmvec's
workers, with Sync and Async for scale: the fastest split is the advice.
On a GPU when torch sees one, else the CPU."""

import pytest
from benchlib import CPUS, time_calls

torch = pytest.importorskip("torch")

SPEC, NUM_ENVS = "CartPole-v1", 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (peer, ShmVecEnv options): every split of the CPUs between caller and workers.
SPLITS = ([("shmvec", {"caller_steps": True, "num_workers": w}) for w in range(CPUS)]
          + [("shmvec", {"caller_steps": False, "num_workers": CPUS}), ("sync", {}),
             # forkserver: fork warns in a process that runs torch threads (Python 3.12+)
             ("async", {"start_method": "forkserver"})])
CONFIGS = [(peer, options, threads) for peer, options in SPLITS for threads in sorted({1, CPUS})]


def _name(peer: str, options: dict, threads: int) -> str:
    if peer == "shmvec":
        peer = f"{'caller+' if options['caller_steps'] else ''}{options['num_workers']}workers"
    return f"{peer}-torch{threads}"


@pytest.fixture
def torch_threads():
    """Restores torch's thread count, which is global."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize(("peer", "options", "threads"), CONFIGS, ids=[_name(*c) for c in CONFIGS])
def test_sampling(benchmark, vector_env, torch_threads, peer, options, threads):
    torch_threads(threads)
    envs = vector_env(peer, SPEC, NUM_ENVS, **options)
    torch.manual_seed(0)
    policy = torch.nn.Sequential(
        torch.nn.Linear(envs.single_observation_space.shape[0], 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, envs.single_action_space.n),
    ).to(DEVICE)
    obs = [envs.reset(seed=0)[0]]

    @torch.inference_mode()
    def sample(_):
        logits = policy(torch.as_tensor(obs[0], device=DEVICE))
        actions = torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(1)
        obs[0] = envs.step(actions.cpu().numpy())[0]

    benchmark.extra_info.update(device=DEVICE, torch_threads=threads)
    time_calls(benchmark, sample, [None], NUM_ENVS, f"sampling-64-{DEVICE}", _name(peer, options, threads))
