from examples.webapp.app import main

main()
