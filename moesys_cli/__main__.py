from moesys_cli.app import main

main()
