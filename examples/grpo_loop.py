"""Group-relative advantages from diffserve rollouts: sample 16 images per prompt, score them with a
toy reward, normalize the rewards within each prompt's group, and form the policy-gradient loss a
GRPO trainer would step on. Start a server on a flow-matching model, then run this:

    diffserve serve --model tiny-flux --batching-mode step --max-n 16 &
    python examples/grpo_loop.py --url http://127.0.0.1:8000
"""
import argparse

import torch

from diffserve.client import Client

PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow star"]


def reward(images: torch.Tensor) -> torch.Tensor:
    """A toy reward per image [n, H, W, 3] uint8: how much redder than green and blue it is."""
    x = images.float() / 255
    return x[..., 0].mean((1, 2)) - x[..., 1:].mean((1, 2, 3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with Client(args.url) as client:
        for iteration in range(args.iterations):
            groups = client.rollout(PROMPTS, n=args.n, num_inference_steps=args.steps,
                                    noise_level=0.7, seed=10_000 * iteration)
            for prompt, group in zip(PROMPTS, groups):
                rewards = reward(group.images)
                advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
                # log_probs [n, T]: with the trainer's weights equal to the server's, the ratio
                # exp(new - old) is 1, and the clipped GRPO loss reduces to this:
                loss = -(advantages[:, None] * group.log_probs).mean()
                print(f"iter {iteration} {prompt!r}: reward {rewards.mean():+.4f} "
                      f"latents {tuple(group.latents.shape)} loss {loss:+.5f} "
                      f"advantages {[round(a, 2) for a in advantages[:4].tolist()]}...")


if __name__ == "__main__":
    main()
