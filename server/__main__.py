from pagedserve.server.cli import main

main()
