from ethpipe.cli import main

main()
