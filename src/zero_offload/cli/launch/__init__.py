"""``zero-offload launch``: the command (``command.py``, DeepSpeed's launcher flags run by
torchrun), the choice between this node and several (``nodes.py``), hostfiles, ``--include`` /
``--exclude`` and SLURM node lists (``hosts.py``), and one launch per node over ssh or srun
(``multinode.py``)."""
