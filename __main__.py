from kvrag.cli.app import run

run()
