"""This machine as moesys sees it: its GPUs, RAM, disks and CPUs, memory caps and peaks, cold page caches, and files
written atomically."""
