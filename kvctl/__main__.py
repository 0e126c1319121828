from kvctl.cli.entry import main

main()
