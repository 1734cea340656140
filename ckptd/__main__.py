from ckptd.cli import run

run()
