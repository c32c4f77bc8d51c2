"""SD3: Stable Diffusion 3: an MM-DiT over flow matching, two CLIPs and T5."""

TITLE = "SD3"
