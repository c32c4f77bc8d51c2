"""The online RL loop's executor side: new denoiser weights prepared and committed between steps,
a whole state synced, and sleeping to give the device to a trainer (``weights``). May import
every room below it."""
