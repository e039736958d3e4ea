"""Patch the models of processes a test spawns too (transformers' FSDP2 and tensor-parallel tests).

Python imports ``sitecustomize`` at startup from the path; the hf-suite puts this folder on the
``PYTHONPATH`` of its pytest runs, so every process they start runs this. Only a process started
under the hf-suite's pytest (which sets ``HF_SUITE_PARENT_PID`` to its own pid) and not that
pytest itself installs the hooks (:func:`hf_suite_plugin.start_child`); anything else is left alone.
"""

import os

if os.environ.get("HF_SUITE_PARENT_PID", str(os.getpid())) != str(os.getpid()):
    import hf_suite_plugin

    hf_suite_plugin.start_child()
