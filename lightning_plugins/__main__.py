from lightning_plugins.cli import main

main()
