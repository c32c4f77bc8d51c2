"""The online RL loop's executor side: new denoiser weights prepared and committed between steps,
a whole state synced (``weights``), and sleeping to give the device to a trainer, every
component back where placement put it at the wake (``sleep``). May import
every room below it."""
