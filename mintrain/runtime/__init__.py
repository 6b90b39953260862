"""What a run needs from its processes and machine: cluster start-up, preemption, the workdir lock, host
memory, hardware peaks, storage paths. None of it knows about models."""
