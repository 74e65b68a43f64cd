"""Support for tests of trainckpt and of programs built on it; nothing here runs in a training
job unless a test asks for it. `faults`: the named fault points of the commit protocols, where a
test kills the process (`TRAINCKPT_FAULT_POINT`) or runs a hook (`on_fault_point`)."""
