from kvctl.cli.app import main

main()
