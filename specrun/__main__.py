from specrun.cli import main

main()
