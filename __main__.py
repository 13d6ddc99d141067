from kvrag.cli.app import main

main()
