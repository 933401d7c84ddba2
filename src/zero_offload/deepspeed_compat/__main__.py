"""``python -m deepspeed ...`` under the opt-in: the ``deepspeed`` command
(``deepspeed.launcher.runner.main``), for environments without DeepSpeed's own script."""

from .launcher.runner import main

if __name__ == "__main__":
    main()
