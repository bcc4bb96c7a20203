"""This machine as moesys sees it: its GPUs, RAM, disks and CPUs, memory caps and peaks, cold page caches, files
written atomically, and the timeline of what its threads and devices did in an offloaded step or token."""
