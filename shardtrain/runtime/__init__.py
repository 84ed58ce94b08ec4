"""The processes a job runs as: the process group from any launcher, relaunching, signals and
preemption, the GPU guard, library chatter, and the hub probe before launch.
"""
